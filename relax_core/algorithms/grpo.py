"""GRPO policy loss: PPO clipped surrogate (asymmetric clip, optional dual clip) per token."""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.common import clipped_surrogate, finish, ratio_of
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings


def grpo_loss(
    inputs: LossInputs,
    settings: LossSettings,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar GRPO loss and detached scalar metrics.

    Per token: ``max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_high))`` (dual-clipped at
    ``-A c`` for A < 0 when ``dual_clip = c``), times the rollout correction weight, plus
    ``kl_coef * KL - entropy_coef * H``, with ``r = exp(logp - old_logp)``, reduced by
    ``settings.agg`` (``num_tokens``/``num_seqs``: the step batch's counts when this is one
    micro-batch).

    Metrics: "pg_loss", "kl", "clip_frac" (share of tokens whose gradient a clip removed),
    "ratio_mean", "entropy" when given, and the correction's metrics when it is on.
    """
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    ratio = ratio_of(inputs.logprobs, inputs.old_logprobs)
    pg, no_grad = clipped_surrogate(
        ratio, inputs.advantages, settings.eps_clip, settings.eps_clip_high, settings.dual_clip
    )
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(no_grad.to(pg.dtype), mask),
            "_token/clipped": no_grad,
            "ratio_mean": masked_mean(ratio, mask),
        }
    return finish(inputs, settings, pg, metrics, num_tokens, num_seqs)
