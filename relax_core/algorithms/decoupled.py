"""Decoupled PPO for stale rows: the PPO ratio is taken against a proximal policy (the trainer's
weights at the start of the update), and a separate, truncated behaviour weight
``pi_prox / pi_behaviour`` corrects for the older weights that generated the rows.

The proximal log-probs come from the actor_fwd role when it runs (``old_logprobs``); otherwise
they are interpolated log-linearly between the behaviour and the current log-probs by policy
version (``proximal_alpha``), which is exact at both ends: on-policy at the first update the
proximal policy is the current one, at later updates of the same batch it is the behaviour one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.common import MAX_LOG_RATIO, clipped_surrogate, finish, ratio_of
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings


def proximal_alpha(behaviour_version: Tensor, train_version: float, progress: float) -> Tensor:
    """Per-row weight of the current log-probs in the interpolated proximal log-probs [B, 1].

    Versions: behaviour b (per row), proximal s = train_version (weights at the start of the
    step), current s + progress (progress = share of this step's updates already applied).
    alpha = (s - b) / (s + progress - b); 1 when the denominator is 0 (current = proximal).
    """
    b = behaviour_version.to(torch.float32).reshape(-1, 1)
    num = train_version - b
    den = train_version + progress - b
    safe = torch.where(den > 0, den, torch.ones_like(den))
    return torch.where(den > 0, num / safe, torch.ones_like(den)).clamp(0.0, 1.0)


def interpolate_proximal(behaviour_lp: Tensor, current_lp: Tensor, alpha: Tensor) -> Tensor:
    """log pi_prox ~ log pi_behaviour + alpha * (log pi_current - log pi_behaviour), detached."""
    return (behaviour_lp + alpha * (current_lp.detach() - behaviour_lp)).detach()


def decoupled_ppo_loss(
    inputs: LossInputs,
    settings: LossSettings,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar loss ``w * max(-A r, -A clip(r))`` with r = pi / pi_prox (``old_logprobs``) and
    w = min(pi_prox / pi_behaviour, behaviour_cap) (``rollout_logprobs``), detached."""
    if inputs.rollout_logprobs is None:
        raise ValueError(
            "decoupled_ppo needs LossInputs.rollout_logprobs (the behaviour policy's log-probs)"
        )
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    ratio = ratio_of(inputs.logprobs, inputs.old_logprobs)
    pg, no_grad = clipped_surrogate(
        ratio, inputs.advantages, settings.eps_clip, settings.eps_clip_high, settings.dual_clip
    )
    log_w = torch.clamp(inputs.old_logprobs - inputs.rollout_logprobs, max=MAX_LOG_RATIO)
    behaviour_w = torch.exp(log_w).clamp(max=settings.behaviour_cap).detach()
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(no_grad.to(pg.dtype), mask),
            "_token/clipped": no_grad,
            "ratio_mean": masked_mean(ratio, mask),
            "behaviour_weight_mean": masked_mean(behaviour_w, mask),
        }
    return finish(inputs, settings, pg * behaviour_w, metrics, num_tokens, num_seqs)
