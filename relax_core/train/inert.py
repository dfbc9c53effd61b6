"""Groups that cannot move the policy: every advantage of every sample 0.

GRPO's group-normalized advantages are all 0 when a group's rewards are equal (every sample
right, or every one wrong). Each policy loss here multiplies its per-token term by the advantage
(the clipped ratio, the sequence ratio, SAPO's gate, CISPO's detached weight, the corrections'
weights), so such a group adds exactly 0 to the gradient; only the KL and entropy terms reach
it. With both off, the trainer can leave the group out of its forward and backward and get the
gradient of the whole batch, provided the loss keeps the batch's denominators (`loss_counts`):
token_mean divides by every loss token of the step batch, seq_mean by every sequence.

The trained rows then differ from the step batch only in their arithmetic's summation order:
the gradient is the same up to floating-point rounding, not bit for bit.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from relax_core.config import AlgorithmConfig
from relax_core.train.batch import Ragged


def can_skip_inert(algo: AlgorithmConfig) -> bool:
    """Whether a zero-advantage row adds nothing to `algo`'s gradient: no KL or entropy term."""
    return algo.kl_coef == 0 and algo.entropy_coef == 0


def loss_counts(table: pa.Table) -> tuple[float, float]:
    """(loss tokens, sequences with at least one) of `table`: the loss's denominators."""
    mask = Ragged.of_column(table.column("loss_mask"))
    running = np.concatenate([[0], np.cumsum(mask.values, dtype=np.int64)])
    per_row = running[mask.offsets[1:]] - running[mask.offsets[:-1]]
    return float(per_row.sum()), float((per_row > 0).sum())


def live_groups(table: pa.Table) -> tuple[pa.Table, int]:
    """`table` without its inert groups, in table order, and how many were left out. When every
    group is inert the first one stays: an optimizer step still happens on a zero gradient
    (AdamW's moments and weight decay move the weights), as it would on the whole batch."""
    if table.column("advantages").null_count:
        return table, 0  # the micro-batches refuse it, naming the column
    adv = Ragged.of_column(table.column("advantages"))
    mask = Ragged.of_column(table.column("loss_mask"))
    lengths = np.diff(adv.offsets)
    if not np.array_equal(lengths, np.diff(mask.offsets)):
        row = int(np.flatnonzero(lengths != np.diff(mask.offsets))[0])
        uid = table.column("uid")[row].as_py()
        raise ValueError(f"row {uid!r}: advantages and loss_mask differ in length")
    # Each column's values from its own first offset: a sliced column's buffer starts earlier.
    a = adv.values[adv.offsets[0] : adv.offsets[-1]]
    m = mask.values[mask.offsets[0] : mask.offsets[-1]]
    moving = (a != 0) & (m != 0)
    row_of = np.repeat(np.arange(table.num_rows), lengths)
    row_live = np.zeros(table.num_rows, dtype=bool)
    row_live[row_of[moving]] = True
    groups = table.column("group_id").to_pylist()
    live = {g for g, is_live in zip(groups, row_live, strict=True) if is_live}
    every = list(dict.fromkeys(groups))
    if not live and every:
        live = {every[0]}
    keep = [i for i, g in enumerate(groups) if g in live]
    if len(keep) == table.num_rows:
        return table, 0
    return table.take(keep), len(every) - len(live)
