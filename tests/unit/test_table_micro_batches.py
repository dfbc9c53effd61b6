"""Queue tables -> micro-batches read the Arrow buffers directly (train/batching.py); what the
trainer gets must equal the micro-batch of the same rows as Python lists, whatever the table's
layout: several chunks (tables put together) and slices (a step batch split into parts)."""

from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest
import torch

from relax_core.queue import rows_to_table
from relax_core.train.batch import MicroBatch, Ragged, make_micro_batch, pad_2d
from relax_core.train.batching import table_micro_batches

PAD = 0


def _rows(seed: int, groups: int, samples: int) -> list[dict]:
    """Groups of samples sharing a prompt; prompts and responses of several lengths (a response
    may be empty), loss masks with holes, advantages per token."""
    rng = random.Random(seed)
    rows = []
    for g in range(groups):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 7))]
        for s in range(samples):
            response = [rng.randrange(1, 50) for _ in range(rng.randrange(0, 5))]
            rows.append(
                {
                    "uid": f"g{g}-s{s}",
                    "group_id": f"g{g}",
                    "prompt_ids": prompt,
                    "response_ids": response,
                    "loss_mask": [rng.randrange(2) for _ in response],
                    "advantages": [rng.uniform(-2, 2) for _ in response],
                }
            )
    return rows


def _same(got: MicroBatch, want: MicroBatch) -> None:
    for name in ("input_ids", "attention_mask", "response_ids", "response_positions", "loss_mask"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.extras.keys() == want.extras.keys()
    for key in got.extras:
        assert torch.equal(got.extras[key], want.extras[key]), key
    assert (got.shared is None) == (want.shared is None)
    if got.shared is not None:
        for a, b in zip(vars(got.shared).values(), vars(want.shared).values(), strict=True):
            assert torch.equal(a, b)


def _check(table: pa.Table, budget: int) -> int:
    """Every micro-batch of `table` equals make_micro_batch on its rows as lists; returns how
    many rows they hold in all."""
    as_lists = table.to_pylist()
    staleness = [[float(i)] * len(row["response_ids"]) for i, row in enumerate(as_lists)]
    held = 0
    batches = table_micro_batches(table, PAD, budget, ("advantages",), {"staleness": staleness})
    for rows, mb in batches:
        picked = [as_lists[i] for i in rows]
        want = make_micro_batch(
            [r["prompt_ids"] for r in picked],
            [r["response_ids"] for r in picked],
            [r["loss_mask"] for r in picked],
            PAD,
            {
                "advantages": [r["advantages"] for r in picked],
                "staleness": [staleness[i] for i in rows],
            },
            share_prompts=True,
        )
        _same(mb, want)
        held += len(rows)
    return held


@pytest.mark.parametrize("budget", [16, 1 << 20])
def test_a_tables_micro_batches_equal_those_of_its_rows_as_lists(budget: int):
    table = rows_to_table(_rows(0, groups=5, samples=4))
    assert _check(table, budget) == table.num_rows


def test_chunked_and_sliced_tables_give_the_rows_they_hold():
    chunked = pa.concat_tables([rows_to_table(_rows(s, 3, 4)) for s in (1, 2, 3)])
    assert chunked.column("prompt_ids").num_chunks == 3
    assert _check(chunked, 24) == 36
    part = chunked.slice(5, 25)  # from inside the first chunk into the third
    assert part.column("prompt_ids").num_chunks == 3
    assert _check(part, 24) == 25
    lone = rows_to_table(_rows(4, 4, 2)).slice(3, 4)  # a sliced array: offsets don't start at 0
    assert lone.column("prompt_ids").chunk(0).offset == 3
    assert _check(lone, 1 << 20) == 4


def test_micro_batch_values_by_hand():
    mb = make_micro_batch(
        [[5, 6, 7], [8]], [[1, 2], []], [[1, 0], []], PAD, {"a": [[0.5, 1.5], []]}
    )
    assert mb.input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 0, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]
    assert mb.response_ids.tolist() == [[1, 2], [0, 0]]
    assert mb.response_positions.tolist() == [[2, 3], [0, 1]]
    assert mb.loss_mask.tolist() == [[1.0, 0.0], [0.0, 0.0]]
    assert mb.extras["a"].tolist() == [[0.5, 1.5], [0.0, 0.0]]
    assert pad_2d([[3], [], [1, 2]], 3, -1, torch.long).tolist() == [
        [3, -1, -1],
        [-1, -1, -1],
        [1, 2, -1],
    ]


def test_a_missing_extra_column_is_named():
    table = rows_to_table([{**r, "advantages": None} for r in _rows(5, 1, 2)])
    with pytest.raises(ValueError, match="'advantages'"):
        table_micro_batches(table, PAD, 1 << 20, ("advantages",))


def test_ragged_rows_of_a_sliced_list_array():
    whole = pa.array([[1, 2], [], [3], [4, 5, 6], None, [7]], pa.list_(pa.int32()))
    part = whole.slice(2, 4)  # [3], [4, 5, 6], None, [7]: its offsets index the whole's values
    ragged = Ragged.of_column(part)
    padded = ragged.padded(np.arange(4), 3, -1, np.int64)
    assert padded.tolist() == [[3, -1, -1], [4, 5, 6], [-1, -1, -1], [7, -1, -1]]
