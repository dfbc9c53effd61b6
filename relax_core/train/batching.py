"""Queue table -> token-budget micro-batches, keeping track of which rows each one holds."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pyarrow as pa

from relax_core.train.batch import MicroBatch, Ragged, micro_batch, split_by_token_budget


def table_micro_batches(
    table: pa.Table,
    pad_token_id: int,
    token_budget: int,
    extras: tuple[str, ...] = (),
    computed: dict[str, list[list[float]]] | None = None,
    resolver: Any = None,
    routed_experts: bool = False,
) -> list[tuple[list[int], MicroBatch]]:
    """Split `table` into micro-batches of at most `token_budget` padded tokens.

    `extras` names per-token list columns (e.g. 'advantages') carried along as [B, R] tensors;
    `computed` adds per-token values that are not columns (one list per row, in table order).
    Returns (row indices, micro-batch) pairs so per-row results can be put back in table order.
    `resolver` (multimodal.inputs.MediaResolver of a multimodal policy) rebuilds each row's
    encoder inputs from its `media` references: decoded media never travel in the queue.
    `routed_experts` (routing replay) carries each row's `routed_experts` column along; a row
    without them, or with other than one entry per token but the last, is a ValueError naming it.
    """
    prompts, responses, masks = (
        Ragged.of_column(table.column(name)) for name in ("prompt_ids", "response_ids", "loss_mask")
    )
    extra_cols = {}
    for name in extras:
        if table.column(name).null_count:
            raise ValueError(f"queue rows are missing column {name!r}; which role should fill it?")
        extra_cols[name] = Ragged.of_column(table.column(name))
    for name, values in (computed or {}).items():
        if len(values) != table.num_rows:
            raise ValueError(f"{name}: {len(values)} rows of values for {table.num_rows} rows")
        extra_cols[name] = Ragged.of_lists(values, np.float32)
    media = table.column("media").to_pylist() if resolver is not None else None
    every = np.arange(table.num_rows)
    lengths = (prompts.lengths(every) + responses.lengths(every)).tolist()
    experts = _routed_experts(table, lengths) if routed_experts else None
    out = []
    for rows in split_by_token_budget(lengths, token_budget):
        mb = micro_batch(
            prompts,
            responses,
            masks,
            pad_token_id,
            np.asarray(rows, dtype=np.int64),
            extra_cols,
            None if experts is None else [experts[i] for i in rows],
            # A group's samples repeat their prompt: the backend runs it once (text rows).
            share_prompts=media is None,
        )
        if media is not None:
            mb = dataclasses.replace(mb, media=[resolver.inputs(media[i]) for i in rows])
        out.append((rows, mb))
    return out


def _routed_experts(table: pa.Table, lengths: list[int]) -> list[list[list[int]]]:
    """The `routed_experts` column, checked: every row has one entry per token of prompt +
    response but the last (the engine's forwards saw no more)."""
    values = table.column("routed_experts").to_pylist()
    uids = table.column("uid").to_pylist()
    for uid, experts, n in zip(uids, values, lengths, strict=True):
        if experts is None:
            raise ValueError(
                f"row {uid!r} has no routed_experts, and train.routing_replay is on; the rollout "
                "engine must return them (SGLang: --enable-return-routed-experts)"
            )
        if len(experts) != n - 1:
            raise ValueError(
                f"row {uid!r}: routed_experts for {len(experts)} tokens; expected {n - 1} "
                "(prompt + response but the last token)"
            )
    return values
