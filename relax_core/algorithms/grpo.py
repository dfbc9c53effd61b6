"""GRPO policy loss: PPO clipped surrogate with asymmetric clip range, KL and entropy terms.

``regularizers`` (KL to the reference, entropy bonus) is kept separate from the surrogate so
the other policy losses (GSPO, SAPO) add the same terms the same way.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import aggregate, check_aggregation, masked_mean
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.kl import check_kl_kind, kl_penalty

# Caps exp() of the log-ratio so a diverged token gives a large finite loss, not inf/NaN;
# e^20 ~ 5e8 is far outside any clip range, so clipping decisions are unchanged.
_MAX_LOG_RATIO = 20.0


def _check_coefs(**coefs: float) -> None:
    for name, value in coefs.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")


def regularizers(
    inputs: LossInputs, *, kl_coef: float, kl_kind: str, entropy_coef: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token ``kl_coef * KL(policy || ref) - entropy_coef * entropy`` [B, T] and metrics.

    Expects padding already zeroed (``LossInputs.zero_padding``). Metrics: "kl" (masked mean,
    0 when the term is off) and "entropy" (masked mean, when ``inputs.entropy`` is given).
    """
    check_kl_kind(kl_kind)
    _check_coefs(kl_coef=kl_coef, entropy_coef=entropy_coef)
    mask = inputs.loss_mask
    extra = torch.zeros_like(inputs.logprobs)
    metrics: dict[str, Tensor] = {"kl": torch.zeros((), dtype=extra.dtype, device=extra.device)}
    if kl_coef > 0:
        if inputs.ref_logprobs is None:
            raise ValueError(
                f"kl_coef={kl_coef} > 0 needs LossInputs.ref_logprobs (reference-model "
                "log-probs), which is None; run the reference role or set kl_coef to 0"
            )
        kl = kl_penalty(inputs.logprobs, inputs.ref_logprobs, kl_kind)
        extra = extra + kl_coef * kl
        metrics["kl"] = masked_mean(kl.detach(), mask)
    if entropy_coef > 0:
        if inputs.entropy is None:
            raise ValueError(
                f"entropy_coef={entropy_coef} > 0 needs LossInputs.entropy, which is None; "
                "compute per-token entropy in the forward pass or set entropy_coef to 0"
            )
        extra = extra - entropy_coef * inputs.entropy
    if inputs.entropy is not None:
        metrics["entropy"] = masked_mean(inputs.entropy.detach(), mask)
    return extra, metrics


def clipped_surrogate(
    ratio: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float
) -> tuple[Tensor, Tensor]:
    """PPO surrogate ``max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_high))``.

    ratio, advantages: [B, T]. Returns the per-token loss [B, T] and a bool [B, T] that is True
    where the clipped term won (the token gives no gradient).
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def grpo_loss(
    inputs: LossInputs,
    *,
    eps_clip: float,
    eps_clip_high: float,
    kl_coef: float,
    kl_kind: str,
    entropy_coef: float,
    agg: str,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar GRPO loss and detached scalar metrics.

    Per token: ``max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high)) + kl_coef * KL
    - entropy_coef * H`` with ``r = exp(logp - old_logp)``, reduced by ``aggregate(agg)``
    (``num_tokens``/``num_seqs``: the step batch's counts when this is one micro-batch).

    Metrics are means over this call's masked tokens: "pg_loss" (the surrogate under ``agg``),
    "kl", "clip_frac" (share of tokens where the clip removed the gradient), "ratio_mean",
    and "entropy" when ``inputs.entropy`` is given.
    """
    check_aggregation(agg)
    _check_coefs(eps_clip=eps_clip, eps_clip_high=eps_clip_high)
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    log_ratio = torch.clamp(inputs.logprobs - inputs.old_logprobs, max=_MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    pg, was_clipped = clipped_surrogate(ratio, inputs.advantages, eps_clip, eps_clip_high)
    extra, metrics = regularizers(
        inputs, kl_coef=kl_coef, kl_kind=kl_kind, entropy_coef=entropy_coef
    )
    loss = aggregate(pg + extra, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs)
    with torch.no_grad():
        metrics["pg_loss"] = aggregate(pg, mask, agg)
        metrics["clip_frac"] = masked_mean(was_clipped.to(pg.dtype), mask)
        metrics["ratio_mean"] = masked_mean(ratio, mask)
    return loss, {name: value.detach() for name, value in metrics.items()}
