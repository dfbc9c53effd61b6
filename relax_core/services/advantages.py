"""Advantages role: group-normalized advantages (GRPO), broadcast over each response's tokens."""

from __future__ import annotations

import pyarrow as pa
import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS
from relax_core.queue import with_columns


def add_advantages(table: pa.Table, estimator: str, normalize_std: bool) -> pa.Table:
    """Fill the `advantages` column ([len(response)] per row) from rewards within each group."""
    group_ids = table.column("group_id").to_pylist()
    index: dict[str, int] = {}
    group_index = torch.tensor([index.setdefault(g, len(index)) for g in group_ids])
    rewards = torch.tensor(table.column("reward").to_pylist(), dtype=torch.float32)
    adv = ADVANTAGE_ESTIMATORS[estimator](rewards, group_index, normalize_std=normalize_std)
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    per_token = [[a] * n for a, n in zip(adv.tolist(), lengths, strict=True)]
    return with_columns(table, advantages=per_token)
