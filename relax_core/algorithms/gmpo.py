"""GMPO: geometric-mean policy optimization (Zhao et al., arXiv 2507.20673, Eq. 4 and the
authors' reference loss).

GRPO maximizes the arithmetic mean of token-level surrogates, which one token with an outlier
ratio can dominate. GMPO maximizes their geometric mean per sequence, with each token's ratio
clipped in log space by the sign of the advantage:

    log s_t = sign(A) * min(sign(A) * log r_t, sign(A) * clip(log r_t, log(1 - eps_clip),
                                                                   log(1 + eps_clip_high)))
    loss    = -A * exp(mean_t log s_t)                      (one value per sequence)

Per token here: every token of a sequence carries the sequence's loss, so ``seq_mean_token_mean``
aggregation gives exactly the per-sequence objective (``token_mean`` weighs sequences by
length). The paper's clip range (e^-0.4, e^0.4) is eps_clip 0.33, eps_clip_high 0.49.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.common import finish
from relax_core.algorithms.corrections import MAX_LOG_RATIO, sequence_mean
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings


def gmpo_loss(
    inputs: LossInputs,
    settings: LossSettings,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar GMPO loss and detached metrics ("clip_frac": share of tokens whose log-ratio the
    clip held, so they give no gradient; "ratio_mean": mean geometric-mean sequence ratio)."""
    if settings.eps_clip >= 1:
        raise ValueError(
            f"gmpo clips log r at log(1 - eps_clip): eps_clip must be < 1, got {settings.eps_clip}"
        )
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    log_ratio = torch.clamp(inputs.logprobs - inputs.old_logprobs, -MAX_LOG_RATIO, MAX_LOG_RATIO)
    clipped = torch.clamp(
        log_ratio, math.log(1.0 - settings.eps_clip), math.log(1.0 + settings.eps_clip_high)
    )
    sign = torch.sign(inputs.advantages)
    held = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = torch.exp(sequence_mean(held, mask))  # [B, 1], the geometric mean
    seq_adv = sequence_mean(inputs.advantages, mask)
    pg = (-seq_adv * seq_ratio).expand_as(log_ratio)
    no_grad = (sign * clipped < sign * log_ratio) & (mask > 0)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean(no_grad.to(pg.dtype), mask),
            "_token/clipped": no_grad,
            "ratio_mean": masked_mean(seq_ratio.expand_as(mask), mask),
        }
    return finish(inputs, settings, pg, metrics, num_tokens, num_seqs)
