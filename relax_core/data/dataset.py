"""Prompt datasets: load JSONL or Parquet rows into validated prompt dicts.

A row is ``{"prompt": str, "answer": str, "meta": dict}`` plus, when the source has them,
``"choices"`` (list of str, for multiple-choice rewards) and ``"media"`` (list of
``{"kind", "uri"}`` dicts, left undecoded). Other fields in the source are ignored.
Paths go through fsspec, so ``s3://bucket/train.jsonl`` works where s3fs is installed.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import posixpath
import tempfile
from collections.abc import Iterator
from typing import Any

from relax_core.config.filesystems import open_url, url_to_fs
from relax_core.multimodal.media import KINDS as MEDIA_KINDS
from relax_core.multimodal.media import resolve_uri

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


class DatasetError(ValueError):
    """A dataset file exists but its content is not a valid prompt dataset."""


def _extension(path: str) -> str:
    for ext in SUPPORTED_EXTENSIONS:
        if path.lower().endswith(ext):
            return ext
    raise DatasetError(
        f"dataset {path!r}: unsupported file type; supported extensions are "
        f"{', '.join(SUPPORTED_EXTENSIONS)}"
    )


def _is_local_relative(path: str) -> bool:
    return "://" not in path and not os.path.isabs(path)


def check_dataset_path(path: str) -> None:
    """Cheap check for config validation: supported extension and the file exists.

    Raises DatasetError for an unsupported extension, FileNotFoundError when missing.
    Does not read the file.
    """
    if not isinstance(path, str) or not path:
        raise DatasetError(f"dataset path must be a non-empty string, got {path!r}")
    _extension(path)
    fs, fs_path = url_to_fs(path)
    if not fs.isfile(fs_path):
        where = f" (relative to the working directory {os.getcwd()})"
        hint = ""
        folder = posixpath.dirname(path)
        if _is_local_relative(path) and os.path.isfile(f"{folder}.py"):
            # A generated dataset (datasets/omni.py writes datasets/omni/): say how to make it.
            hint = f"; generate it with: python {folder}.py --out {folder}"
        raise FileNotFoundError(
            f"dataset file not found: {path!r}{where if _is_local_relative(path) else ''}{hint}"
        )


def _answer_str(value: Any, where: str) -> str:
    # bool is an int subclass; a True/False answer is almost surely a broken column.
    if isinstance(value, bool):
        raise DatasetError(f"{where}: field 'answer' must be a string or number, got a bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DatasetError(f"{where}: field 'answer' is {value}, not a finite number")
        # Parquet/JSON writers often store integers as floats; "46.0" would not match "46".
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: field 'answer' is empty")
        return value
    raise DatasetError(
        f"{where}: field 'answer' must be a string or number, got {type(value).__name__}"
    )


def _meta_dict(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if isinstance(value, str):
        # Parquet cannot hold free-form dicts with varying keys, so meta may arrive as JSON text.
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: field 'meta' is a string but not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise DatasetError(f"{where}: field 'meta' must be an object, got {type(value).__name__}")
    return value


def _check_choices(value: Any, where: str) -> list:
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise DatasetError(f"{where}: field 'choices' must be a list of strings")
    return value


def _check_media(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise DatasetError(f"{where}: field 'media' must be a list of {{kind, uri}} objects")
    for i, item in enumerate(value):
        if not isinstance(item, dict) or not all(
            isinstance(item.get(k), str) and item.get(k) for k in ("kind", "uri")
        ):
            raise DatasetError(
                f"{where}: field 'media' item {i} must be an object with non-empty 'kind' and 'uri'"
            )
        if item["kind"] not in MEDIA_KINDS:
            raise DatasetError(
                f"{where}: field 'media' item {i} has kind {item['kind']!r}; kinds are "
                f"{', '.join(MEDIA_KINDS)}"
            )
    return value


def validate_row(raw: Any, where: str) -> dict:
    """Turn one source record into a prompt row; ``where`` names it in errors (e.g. 'f.jsonl:3')."""
    if not isinstance(raw, dict):
        raise DatasetError(f"{where}: row must be a JSON object, got {type(raw).__name__}")
    prompt = raw.get("prompt")
    if prompt is None:
        raise DatasetError(f"{where}: missing field 'prompt'")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DatasetError(f"{where}: field 'prompt' must be a non-empty string")
    if raw.get("answer") is None:
        raise DatasetError(f"{where}: missing field 'answer'")
    row = {
        "prompt": prompt,
        "answer": _answer_str(raw["answer"], where),
        "meta": _meta_dict(raw.get("meta"), where),
    }
    if raw.get("choices") is not None:
        row["choices"] = _check_choices(raw["choices"], where)
    if raw.get("media") is not None:
        row["media"] = _check_media(raw["media"], where)
    return row


def _jsonl_records(path: str) -> Iterator[tuple[str, Any]]:
    with open_url(path, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                yield where, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON: {exc.msg}") from None


def _parquet_records(path: str) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        with open_url(path, "rb") as f:
            table = pq.read_table(f)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DatasetError(f"{path}: not a readable Parquet file: {exc}") from None
    for i, record in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {i}", record


def load_prompts(path: str) -> list[dict]:
    """Read every row of a ``.jsonl`` or ``.parquet`` prompt dataset, validated.

    JSONL errors name ``file:line``; Parquet errors name ``file: row N`` (1-based).
    Raises FileNotFoundError for a missing file and DatasetError (a ValueError) for anything else.
    """
    check_dataset_path(path)
    records = _jsonl_records(path) if _extension(path) == ".jsonl" else _parquet_records(path)
    rows = [validate_row(raw, where) for where, raw in records]
    if not rows:
        raise DatasetError(f"dataset {path!r} has no rows")
    # Media paths are relative to the dataset's folder; every role reads rows from the queue, far
    # from the dataset file, so they travel resolved.
    base = posixpath.dirname(path) if "://" in path else os.path.dirname(os.path.abspath(path))
    for row in rows:
        for item in row.get("media") or []:
            item["uri"] = resolve_uri(item["uri"], base)
    return rows


def fingerprint(path: str) -> str:
    """sha256 of the file's bytes: changes whenever the dataset does (a cache key for warm starts)."""
    digest = hashlib.sha256()
    with open_url(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_prompts(rows: list[dict], path: str) -> None:
    """Write rows as JSONL, one object per line; the file appears whole or not at all."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".jsonl")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a shipped data file should be world-readable
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
