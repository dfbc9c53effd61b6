"""Rollout-vs-train corrections: weights or masks for tokens the rollout engine sampled under
log-probs that differ from the trainer's (another kernel, another precision, stale weights).

Per token ``log w = old_logprobs - rollout_logprobs`` (the trainer's proximal policy over the
engine's). One per-token weight family (``is_mode``) and one sequence mask (``seq_mask``):

- ``tis`` truncated IS, ``w = min(w, is_cap)``; ``mis`` masked IS, ``w`` kept inside
  ``[1/is_cap, is_cap]`` and 0 outside (both at ``is_level`` token, sequence or geometric);
- ``icepop``: IcePop (Ling team, "Every Step Evolves", arXiv 2510.18855, Sec. 3): a token keeps
  ``w`` only while ``icepop_low <= w <= icepop_high`` and is masked (0) outside the band, so a
  token the two engines disagree on strongly gives no gradient at all (token level only);
- ``is_level: geometric``: one weight per sequence, the geometric mean of its token weights,
  ``exp(mean_t log w_t)`` (GMPO's/GSPO's length-normalized ratio, arXiv 2507.20673), which stays
  near 1 on long responses where the product ``exp(sum_t log w_t)`` of ``sequence`` explodes;
- ``seq_mask``: OPSM, off-policy sequence masking (DeepSeek-V3.2, arXiv 2512.02556, Sec. 3.1):
  ``kl`` drops a negative-advantage sequence whose mean ``rollout_logprobs - logprobs`` (a KL
  estimate of the sampling policy against the current one) exceeds ``seq_mask_threshold``;
  ``ratio`` drops any sequence whose geometric-mean ratio current/rollout lies outside
  ``[exp(-threshold), exp(threshold)]``.

Every weight and mask is detached: corrections scale gradients, they are never trained through.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings

# Caps exp() of a log-ratio so a diverged token gives a large finite loss, not inf/NaN.
MAX_LOG_RATIO = 20.0


def _rollout(inputs: LossInputs, what: str) -> Tensor:
    if inputs.rollout_logprobs is None:
        raise ValueError(
            f"{what} needs LossInputs.rollout_logprobs (the rollout engine's log-probs), "
            "which is None"
        )
    return inputs.rollout_logprobs


def sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """[B, 1] mean of `values` [B, T] over each row's masked tokens (0 for an empty row)."""
    return (values * mask).sum(dim=-1, keepdim=True) / mask.sum(dim=-1, keepdim=True).clamp(min=1.0)


def importance_weights(
    inputs: LossInputs, settings: LossSettings
) -> tuple[Tensor | None, dict[str, Tensor]]:
    """Detached per-token weights [B, T] of ``settings.is_mode``, or None when it is "none"."""
    if settings.is_mode == "none":
        return None, {}
    mask = inputs.loss_mask
    log_w = (inputs.old_logprobs - _rollout(inputs, f"is_mode={settings.is_mode!r}")).detach()
    log_w = log_w * mask
    if settings.is_level == "sequence":
        log_w = log_w.sum(dim=-1, keepdim=True).expand_as(log_w)
    elif settings.is_level == "geometric":
        log_w = sequence_mean(log_w, mask).expand_as(log_w)
    w = torch.exp(torch.clamp(log_w, min=-MAX_LOG_RATIO, max=MAX_LOG_RATIO))
    metrics = {"is_weight_mean": masked_mean(w, mask)}
    if settings.is_mode == "tis":
        metrics["is_truncated_frac"] = masked_mean((w > settings.is_cap).to(w.dtype), mask)
        return torch.clamp(w, max=settings.is_cap), metrics
    if settings.is_mode == "icepop":
        keep = (w >= settings.icepop_low) & (w <= settings.icepop_high)
    else:
        keep = (w <= settings.is_cap) & (w >= 1.0 / settings.is_cap)
    metrics["is_masked_frac"] = masked_mean((~keep).to(w.dtype), mask)
    return torch.where(keep, w, torch.zeros_like(w)), metrics


def sequence_mask(inputs: LossInputs, settings: LossSettings) -> tuple[Tensor | None, dict]:
    """Detached [B, 1] float mask of ``settings.seq_mask`` (1 keeps a sequence), or None."""
    if settings.seq_mask == "none":
        return None, {}
    mask = inputs.loss_mask
    rollout = _rollout(inputs, f"seq_mask={settings.seq_mask!r}")
    gap = sequence_mean((rollout - inputs.logprobs).detach(), mask)  # [B, 1]
    if settings.seq_mask == "kl":
        negative = sequence_mean(inputs.advantages.detach(), mask) < 0
        drop = negative & (gap > settings.seq_mask_threshold)
    else:
        drop = gap.abs() > settings.seq_mask_threshold
    live = (mask.sum(dim=-1, keepdim=True) > 0).to(gap.dtype)
    dropped = drop.to(gap.dtype) * live
    frac = dropped.sum() / live.sum().clamp(min=1.0)
    return 1.0 - dropped, {"seq_masked_frac": frac}


def apply_corrections(
    inputs: LossInputs, settings: LossSettings, pg: Tensor
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``pg`` [B, T] times every correction's weight; also the bool [B, T] of trained tokens
    whose weight is 0 (masked) and the corrections' metrics."""
    weights, metrics = importance_weights(inputs, settings)
    seq_keep, seq_metrics = sequence_mask(inputs, settings)
    metrics.update(seq_metrics)
    if seq_keep is not None:
        weights = seq_keep.expand_as(pg) if weights is None else weights * seq_keep
    if weights is None:
        return pg, torch.zeros_like(pg, dtype=torch.bool), metrics
    return pg * weights, (weights == 0) & (inputs.loss_mask > 0), metrics
