"""Pieces every policy loss shares: the clipped surrogate, KL/entropy regularizers, and the
final step (rollout-vs-train corrections, corrections.py; aggregation; metrics).

A loss computes its per-token policy-gradient term [B, T] its own way (GRPO's clipped ratio,
GSPO's sequence ratio, SAPO's soft gate) and hands it to ``finish``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import aggregate, check_aggregation, masked_mean
from relax_core.algorithms.corrections import MAX_LOG_RATIO, apply_corrections
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.kl import check_kl_kind, kl_penalty
from relax_core.algorithms.settings import LossSettings


def ratio_of(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """exp(logp - old_logp), [B, T], with the exponent capped at MAX_LOG_RATIO."""
    return torch.exp(torch.clamp(logprobs - old_logprobs, max=MAX_LOG_RATIO))


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float, dual_clip: float = 0.0
) -> tuple[Tensor, Tensor]:
    """PPO surrogate ``max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))``.

    With ``dual_clip = c > 1`` a negative-advantage token's loss is also capped at ``-A * c``
    (a huge ratio on a bad token cannot dominate the batch). ratio, advantages: [B, T].
    Returns the per-token loss [B, T] and a bool [B, T], True where a clip removed the gradient.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    loss = torch.maximum(unclipped, clipped)
    no_grad = clipped > unclipped
    if dual_clip > 0:
        cap = -advantages * dual_clip
        capped = (advantages < 0) & (loss > cap)
        loss = torch.where(capped, cap, loss)
        no_grad = no_grad | capped
    return loss, no_grad


def regularizers(inputs: LossInputs, settings: LossSettings) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token ``kl_coef * KL(policy || ref) - entropy_coef * entropy`` [B, T] and metrics.

    Expects padding already zeroed (``LossInputs.zero_padding``). Metrics: "kl" (masked mean,
    0 when the term is off) and "entropy" (masked mean, when ``inputs.entropy`` is given).
    """
    check_kl_kind(settings.kl_kind)
    mask = inputs.loss_mask
    extra = torch.zeros_like(inputs.logprobs)
    metrics: dict[str, Tensor] = {"kl": torch.zeros((), dtype=extra.dtype, device=extra.device)}
    if settings.kl_coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError(
                f"kl_coef={settings.kl_coef} > 0 needs LossInputs.ref_logprobs (reference-model "
                "log-probs), which is None; run the reference role or set kl_coef to 0"
            )
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, settings.kl_kind)
        extra = extra + settings.kl_coef * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if settings.entropy_coef > 0:
        if inputs.entropy is None:
            raise ValueError(
                f"entropy_coef={settings.entropy_coef} > 0 needs LossInputs.entropy, which is "
                "None; compute per-token entropy in the forward pass or set entropy_coef to 0"
            )
        extra = extra - settings.entropy_coef * inputs.entropy
    if inputs.entropy is not None:
        metrics["entropy"] = masked_mean(inputs.entropy.detach(), mask)
    return extra, metrics


def finish(
    inputs: LossInputs,
    settings: LossSettings,
    pg: Tensor,
    metrics: dict[str, Tensor],
    num_tokens: float | None,
    num_seqs: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss = aggregate(w * pg + regularizers) and detached metrics: scalars and, with
    ``settings.token_masks``, the bool [B, T] masks "_token/masked" (a correction zeroed the
    token) and "_token/clipped" (a clip removed its gradient, for losses that clip; they pass it
    in ``metrics`` under that key)."""
    check_aggregation(settings.agg)
    pg, masked, correction_metrics = apply_corrections(inputs, settings, pg)
    clipped = metrics.pop("_token/clipped", None)
    if settings.token_masks:
        metrics["_token/masked"] = masked
        if clipped is not None:
            metrics["_token/clipped"] = clipped & (inputs.loss_mask > 0)
    extra, reg_metrics = regularizers(inputs, settings)
    mask = inputs.loss_mask
    loss = aggregate(
        pg + extra, mask, settings.agg, num_tokens, num_seqs, norm_len=settings.norm_len
    )
    with torch.no_grad():
        metrics["pg_loss"] = aggregate(pg, mask, settings.agg, norm_len=settings.norm_len)
    metrics.update(reg_metrics)
    metrics.update(correction_metrics)
    return loss, {name: value.detach() for name, value in metrics.items()}
