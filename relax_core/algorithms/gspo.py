"""GSPO: one importance ratio per sequence, ``s = exp(mean_t(logp - old_logp))`` over the loss
mask, clipped like PPO (with a small range, e.g. 3e-4 / 4e-4).

Written in the token form: each token carries ``sg[s] * exp(logp - sg[logp])``, whose value is
``s`` and whose gradient is ``s * grad(logp)``; with ``seq_mean_token_mean`` aggregation that is
exactly the sequence-level GSPO gradient ``-A * grad(s)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.common import MAX_LOG_RATIO, clipped_surrogate, finish
from relax_core.algorithms.corrections import sequence_mean
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings


def gspo_loss(
    inputs: LossInputs,
    settings: LossSettings,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar GSPO loss and detached metrics ("clip_frac" counts clipped sequences' tokens,
    "ratio_mean" is the mean sequence ratio over tokens)."""
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    seq_log_ratio = sequence_mean(inputs.logprobs - inputs.old_logprobs, mask)
    seq_ratio = torch.exp(torch.clamp(seq_log_ratio, max=MAX_LOG_RATIO)).detach()
    token_ratio = seq_ratio * torch.exp(inputs.logprobs - inputs.logprobs.detach())
    pg, no_grad = clipped_surrogate(
        token_ratio,
        inputs.advantages,
        settings.eps_clip,
        settings.eps_clip_high,
        settings.dual_clip,
    )
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(no_grad.to(pg.dtype), mask),
            "_token/clipped": no_grad,
            "ratio_mean": masked_mean(seq_ratio.expand_as(mask), mask),
        }
    return finish(inputs, settings, pg, metrics, num_tokens, num_seqs)
