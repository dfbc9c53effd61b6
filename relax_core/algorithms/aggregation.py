"""Reduce a per-token loss [B, T] to the scalar the optimizer sees.

With gradient accumulation each micro-batch is aggregated on its own; pass the step batch's
global counts (``num_tokens``/``num_seqs``) so the micro-batch losses add up to exactly the loss
of the whole step batch, whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def _masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    # where(), not values * mask: padding may hold inf, and inf * 0 is NaN.
    kept = torch.where(mask > 0, values * mask, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def _denominator(count: Tensor, given: float | None, name: str) -> Tensor | float:
    if given is None:
        # An empty mask gives 0 / 1 = 0, still a graph node, so backward() works and is zero.
        return count.clamp(min=1.0)
    if given < 0:
        raise ValueError(f"{name} must be >= 0, got {given}")
    return max(float(given), 1.0)


def token_mean(
    values: Tensor,
    mask: Tensor,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float = 0.0,
) -> Tensor:
    """``sum(v * m) / sum(m)`` over every token of the batch; ``num_tokens`` replaces sum(m).

    Long responses weigh more, per token, than in ``seq_mean_token_mean``. ``num_seqs`` and
    ``norm_len`` are accepted and ignored so every aggregation has one call shape.
    """
    del num_seqs, norm_len
    return _masked_sum(values, mask) / _denominator(mask.sum(), num_tokens, "num_tokens")


def seq_mean_token_mean(
    values: Tensor,
    mask: Tensor,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float = 0.0,
) -> Tensor:
    """Mean over sequences with >= 1 masked token of each sequence's token mean.

    ``num_seqs`` replaces the local count of such sequences; ``num_tokens`` is ignored.
    """
    del num_tokens, norm_len
    tokens_per_seq = mask.sum(dim=-1)
    per_seq = _masked_sum(values, mask, dim=-1) / tokens_per_seq.clamp(min=1.0)
    live_seqs = (tokens_per_seq > 0).to(values.dtype).sum()
    return per_seq.sum() / _denominator(live_seqs, num_seqs, "num_seqs")


def dr_grpo(
    values: Tensor,
    mask: Tensor,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float = 0.0,
) -> Tensor:
    """Dr. GRPO: ``sum(v * m) / (num_seqs * norm_len)``, a denominator fixed by the batch size
    and the generation budget, so neither long nor short responses change a token's weight.

    ``num_seqs`` (sequences with >= 1 masked token, as in ``seq_mean_token_mean``) replaces
    the local count.
    """
    del num_tokens
    if norm_len <= 0:
        raise ValueError(f"dr_grpo aggregation needs norm_len > 0, got {norm_len}")
    live = (mask.sum(dim=-1) > 0).to(values.dtype).sum()
    seqs = _denominator(live, num_seqs, "num_seqs")
    return _masked_sum(values, mask) / (seqs * norm_len)


AGGREGATIONS: dict[str, Callable[..., Tensor]] = {
    "token_mean": token_mean,
    "seq_mean_token_mean": seq_mean_token_mean,
    "dr_grpo": dr_grpo,
}


def check_aggregation(mode: str) -> None:
    """Raise ValueError unless ``mode`` names an aggregation."""
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; allowed: {sorted(AGGREGATIONS)}")


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: float = 0.0,
) -> Tensor:
    """Scalar loss from per-token ``values`` [B, T] under ``mask`` [B, T] (float or bool 0/1).

    mode: "token_mean", "seq_mean_token_mean" or "dr_grpo". num_tokens / num_seqs: the step
    batch's total masked tokens / sequences (with >= 1 masked token; all of them for dr_grpo),
    for micro-batching. norm_len: dr_grpo's fixed length. An empty mask gives 0, never NaN.
    """
    check_aggregation(mode)
    if values.shape != mask.shape or values.dim() != 2:
        raise ValueError(
            f"aggregate needs values and mask of one shape [B, T], got {tuple(values.shape)} "
            f"and {tuple(mask.shape)}"
        )
    return AGGREGATIONS[mode](values, mask.to(values.dtype), num_tokens, num_seqs, norm_len)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over masked tokens of this batch (0 when none), for metrics."""
    return token_mean(values, mask.to(values.dtype))
