"""Splitting a step's micro-batches over a trainer's data-parallel ranks (FSDP2 and Megatron).

Data-parallel rank r of W takes micro-batches r, r+W, r+2W, ... (`dp_share`). Every rank runs
the same number of forwards (`rounds`): a rank whose share is shorter runs padding forwards of
micro-batch 0, zero-weighted in training (`zero_weighted`), so the collectives inside the model
(FSDP2's all-gathers, Megatron's MoE token all-to-all) pair up. The loss functions normalise by
the whole step's tokens, so each rank's loss is its share of the step loss and gradients are
summed over ranks, not averaged. Metrics are summed over ranks (`sum_over_group`); log-probs are
broadcast by the rank that scored them (`broadcast_owned`), so every rank returns all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from relax_core.train.backend import MicroBatchLoss
from relax_core.train.batch import MicroBatch


@dataclass(frozen=True)
class DPShare:
    """One data-parallel rank's part of a step's micro-batches."""

    indices: tuple[int, ...]
    """Micro-batches this rank runs, in order."""
    padding: int
    """Padding forwards (of micro-batch 0) it runs after them, so every rank runs `rounds`."""

    @property
    def rounds(self) -> int:
        return len(self.indices) + self.padding


def dp_share(num_micro_batches: int, rank: int, size: int) -> DPShare:
    """Rank `rank` of `size` takes micro-batches rank, rank + size, ...; padding makes every
    rank's count ceil(num_micro_batches / size)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"bad data-parallel rank {rank} of size {size}")
    if num_micro_batches < 0:
        raise ValueError(f"num_micro_batches must be >= 0, got {num_micro_batches}")
    indices = tuple(range(rank, num_micro_batches, size))
    rounds = -(-num_micro_batches // size)
    return DPShare(indices, rounds - len(indices))


def zero_weighted(loss_fn: MicroBatchLoss) -> MicroBatchLoss:
    """`loss_fn` scaled by 0: a forward/backward that adds nothing to the gradients or the
    metrics but keeps a rank's collectives paired with the others'."""

    def zero(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        loss, metrics = loss_fn(logprobs, entropy, mb)
        return loss * 0.0, {k: torch.as_tensor(v) * 0.0 for k, v in metrics.items()}

    return zero


def sum_over_group(sums: dict[str, float], group: Any, device: torch.device) -> dict[str, float]:
    """Each rank's metric sums (its rows' share of the step mean) added over `group`; every rank
    must report the same keys (each runs at least one micro-batch, padding included)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return dict(sums)
    keys = sorted(sums)
    values = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(values, group=group)
    return dict(zip(keys, values.tolist(), strict=True))


def broadcast_owned(
    micro_batches: list[MicroBatch],
    mine: dict[int, torch.Tensor],
    group: Any,
    size: int,
    empty: Callable[[MicroBatch], torch.Tensor],
) -> list[torch.Tensor]:
    """Every micro-batch's tensor on every rank: micro-batch i comes from group rank i % size
    (its owner, which put it in `mine`); the others receive into `empty(mb)`."""
    if size == 1:
        return [mine[i] for i in range(len(micro_batches))]
    import torch.distributed as dist

    out = []
    for i, mb in enumerate(micro_batches):
        tensor = mine.get(i)
        if tensor is None:
            tensor = empty(mb)
        dist.broadcast(tensor, src=dist.get_global_rank(group, i % size), group=group)
        out.append(tensor)
    return out
