"""The one Arrow row schema that every stage of the data bus stores, and conversions to and from it.

One row is one response (one sample of a group). Columns are only ever added, never repurposed; the
columns later roles fill (`ref_logprobs`, `old_logprobs`, `advantages`, ...) are nullable so the
rollout stage can write rows without them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SCHEMA_VERSION = "1"
FINISH_REASONS = ("stop", "length", "abort")

_MEDIA_ITEM = pa.struct(
    [
        pa.field("kind", pa.string()),
        pa.field("uri", pa.string()),
        pa.field("bytes", pa.binary()),
    ]
)

ROW_SCHEMA: pa.Schema = pa.schema(
    [
        pa.field("uid", pa.string(), nullable=False),
        pa.field("group_id", pa.string(), nullable=False),
        pa.field("prompt_index", pa.int64()),
        pa.field("epoch", pa.int32()),
        pa.field("prompt_ids", pa.list_(pa.int32())),
        pa.field("response_ids", pa.list_(pa.int32())),
        pa.field("loss_mask", pa.list_(pa.int8())),
        pa.field("rollout_logprobs", pa.list_(pa.float32())),
        pa.field("reward", pa.float32()),
        pa.field("reward_info", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("behaviour_version_min", pa.int64()),
        pa.field("behaviour_version_max", pa.int64()),
        pa.field("turns", pa.int32()),
        pa.field("media", pa.list_(_MEDIA_ITEM)),
        pa.field("ref_logprobs", pa.list_(pa.float32())),
        pa.field("old_logprobs", pa.list_(pa.float32())),
        pa.field("advantages", pa.list_(pa.float32())),
        pa.field("teacher_logprobs", pa.list_(pa.float32())),
        pa.field("routed_experts", pa.list_(pa.list_(pa.int32()))),
    ],
    metadata={"relax.row_schema_version": SCHEMA_VERSION},
)

REQUIRED_COLUMNS: tuple[str, ...] = tuple(f.name for f in ROW_SCHEMA if not f.nullable)
PER_TOKEN_COLUMNS: tuple[str, ...] = tuple(
    f.name
    for f in ROW_SCHEMA
    if pa.types.is_list(f.type) and pa.types.is_primitive(f.type.value_type)
)
"""List columns of one number per token (ids, masks, log-probs, advantages)."""
_COLUMN_NAMES = frozenset(ROW_SCHEMA.names)


def _leaf_type(t: pa.DataType) -> pa.DataType:
    while pa.types.is_list(t) or pa.types.is_large_list(t):
        t = t.value_type
    return t


def _is_integer_column(t: pa.DataType) -> bool:
    return pa.types.is_integer(_leaf_type(t))


def _convert_one(values: Sequence[Any], field: pa.Field) -> pa.Array:
    """Convert python values to `field.type`, refusing lossy conversions pyarrow would allow.

    pyarrow silently truncates 1.5 to 1 when asked for an integer type, which would turn a
    log-prob column passed by mistake into plausible-looking token ids; integer columns are
    therefore inferred first and only accepted when their values are integers.
    """
    if not _is_integer_column(field.type):
        return pa.array(values, type=field.type)
    inferred = pa.array(values)
    leaf = _leaf_type(inferred.type)
    if not (pa.types.is_integer(leaf) or pa.types.is_null(leaf)):
        raise TypeError(f"expected integers, got values of type {leaf}")
    return inferred.cast(field.type, safe=True)


def _first_bad_row(values: Sequence[Any], field: pa.Field) -> tuple[int, str]:
    for i, value in enumerate(values):
        try:
            _convert_one([value], field)
        except (pa.ArrowException, TypeError, ValueError, OverflowError) as err:
            return i, str(err)
    return -1, "the column as a whole could not be converted"


def _column_array(values: list[Any], field: pa.Field) -> pa.Array:
    try:
        return _convert_one(values, field)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as err:
        row, reason = _first_bad_row(values, field)
        where = f"row {row}" if row >= 0 else "rows"
        raise ValueError(
            f"column {field.name!r}, {where}: cannot store as {field.type} ({reason or err})"
        ) from err


_ENCODE_SORTED = json.JSONEncoder(sort_keys=True).encode
"""json.dumps(value, sort_keys=True) without building an encoder per call (one per row)."""


def _normalize_reward_info(value: Any, row: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        return _ENCODE_SORTED(value)
    if isinstance(value, str):
        try:
            json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"column 'reward_info', row {row}: not JSON text ({err})") from err
        return value
    raise ValueError(
        f"column 'reward_info', row {row}: expected JSON text or a dict, got {type(value).__name__}"
    )


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """Build a ROW_SCHEMA table from one dict per row; absent keys become nulls.

    `reward_info` may be given as a dict (stored as JSON text). Raises ValueError naming the
    column and row for a missing required value, an unknown key or a value of the wrong type.
    """
    for i, row in enumerate(rows):
        unknown = row.keys() - _COLUMN_NAMES
        if unknown:
            raise ValueError(
                f"row {i}: unknown column(s) {sorted(unknown)}; known columns: {ROW_SCHEMA.names}"
            )
        for name in REQUIRED_COLUMNS:
            if row.get(name) is None:
                raise ValueError(f"row {i}: required column {name!r} is missing or null")
    columns = {name: [row.get(name) for row in rows] for name in ROW_SCHEMA.names}
    columns["reward_info"] = [
        _normalize_reward_info(v, i) for i, v in enumerate(columns["reward_info"])
    ]
    arrays = [_column_array(columns[f.name], f) for f in ROW_SCHEMA]
    table = pa.Table.from_arrays(arrays, schema=ROW_SCHEMA)
    _check_values(table, check_domains=True)
    return table


def table_to_rows(table: pa.Table) -> list[dict[str, Any]]:
    """One dict per row with every ROW_SCHEMA column (nulls as None, lists as python lists)."""
    return validate_table(table).to_pylist()


def with_columns(table: pa.Table, **columns: Any) -> pa.Table:
    """Return `table` with the named columns replaced, e.g. `advantages=[[0.5, 0.5], ...]`.

    Each value is a python sequence or Arrow array with one entry per row. The result keeps
    ROW_SCHEMA; an unknown name, a wrong length or a wrong type raises ValueError naming it.
    """
    table = validate_table(table)
    for name, values in columns.items():
        if name not in _COLUMN_NAMES:
            raise ValueError(f"unknown column {name!r}; known columns: {ROW_SCHEMA.names}")
        if len(values) != table.num_rows:
            raise ValueError(
                f"column {name!r}: got {len(values)} values for a table of {table.num_rows} rows"
            )
        field = ROW_SCHEMA.field(name)
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            array = _cast_arrow(values, field)
        else:
            if name == "reward_info":
                values = [_normalize_reward_info(v, i) for i, v in enumerate(values)]
            array = _column_array(list(values), field)
        table = table.set_column(ROW_SCHEMA.get_field_index(name), field, array)
    _check_values(table, check_domains=True)
    return table


def _cast_arrow(values: pa.Array | pa.ChunkedArray, field: pa.Field) -> pa.Array | pa.ChunkedArray:
    if values.type == field.type:
        return values
    if _is_integer_column(field.type) and not _is_integer_column(values.type):
        raise ValueError(f"column {field.name!r}: expected integers, got {values.type}")
    try:
        return values.cast(field.type, safe=True)
    except pa.ArrowException as err:
        raise ValueError(
            f"column {field.name!r}: cannot cast {values.type} to {field.type}"
        ) from err


def validate_table(table: pa.Table, check_domains: bool = True) -> pa.Table:
    """Check `table` holds exactly the ROW_SCHEMA columns with their types and valid values.

    Returns the table in ROW_SCHEMA column order with the schema's metadata. Raises ValueError
    naming the missing, extra and mistyped columns. `check_domains=False` skips the value-domain
    checks (finish_reason) but keeps the null checks: readers of rows a writer already validated
    only need what keeps them from crashing.
    """
    if not isinstance(table, pa.Table):
        raise TypeError(f"expected a pyarrow.Table, got {type(table).__name__}")
    if table.schema.equals(ROW_SCHEMA, check_metadata=True):  # the common case, checked fast
        _check_values(table, check_domains)
        return table
    names = set(table.column_names)
    missing = [n for n in ROW_SCHEMA.names if n not in names]
    extra = [n for n in table.column_names if n not in _COLUMN_NAMES]
    mistyped = [
        f"{f.name} ({table.schema.field(f.name).type}, expected {f.type})"
        for f in ROW_SCHEMA
        if f.name in names and table.schema.field(f.name).type != f.type
    ]
    duplicated = len(table.column_names) != len(names)
    if missing or extra or mistyped or duplicated:
        problems = []
        if missing:
            problems.append(f"missing columns {missing}")
        if extra:
            problems.append(f"extra columns {extra}")
        if mistyped:
            problems.append(f"mistyped columns {mistyped}")
        if duplicated:
            problems.append("duplicated column names")
        raise ValueError("table does not match ROW_SCHEMA: " + "; ".join(problems))
    if table.column_names != ROW_SCHEMA.names:
        table = table.select(ROW_SCHEMA.names)
    if not table.schema.equals(ROW_SCHEMA, check_metadata=True):
        table = pa.Table.from_arrays(table.columns, schema=ROW_SCHEMA)
    _check_values(table, check_domains)
    return table


def _check_values(table: pa.Table, check_domains: bool) -> None:
    for name in REQUIRED_COLUMNS:
        nulls = table.column(name).null_count
        if nulls:
            raise ValueError(f"required column {name!r} has {nulls} null value(s)")
    for name in PER_TOKEN_COLUMNS:
        # A row may lack the list (a role has not filled it), not hold a null token in it: the
        # trainer reads these lists' values straight into tensors (train/batch.py Ragged).
        column = table.column(name)
        # The children's counts are O(1) (a slice's child can hold another row's null: exact check)
        if any(c.values.null_count for c in column.chunks) and pc.list_flatten(column).null_count:
            row = next(i for i, v in enumerate(column.to_pylist()) if v and None in v)
            raise ValueError(f"column {name!r}, row {row}: a null inside the list")
    if not check_domains:
        return
    finish = table.column("finish_reason").to_pylist()
    # Entries hold tens to hundreds of rows: a set is cheaper than a compute kernel's fixed cost.
    for value in set(finish):
        if value is not None and value not in FINISH_REASONS:
            row = finish.index(value)
            raise ValueError(
                f"column 'finish_reason', row {row}: {value!r} is not one of {list(FINISH_REASONS)}"
            )


def check_whole_groups(table: pa.Table, group_size: int) -> None:
    """Raise ValueError if any group_id occurs a number of times other than `group_size`.

    Groups are the unit that moves through the bus; a split group would normalize its rewards
    against the wrong peers.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    counts = pc.value_counts(table.column("group_id"))
    wrong = [
        (c["values"].as_py(), c["counts"].as_py())
        for c in counts
        if c["counts"].as_py() != group_size
    ]
    if wrong:
        shown = ", ".join(f"{g!r} has {n}" for g, n in wrong[:5])
        more = f" (and {len(wrong) - 5} more)" if len(wrong) > 5 else ""
        raise ValueError(
            f"{len(wrong)} group(s) are not whole (expected {group_size} rows each): {shown}{more}"
        )
