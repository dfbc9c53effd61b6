"""CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1, arXiv 2506.13585,
Sec. 3.1, Eq. 4).

PPO's clip removes the gradient of a token whose ratio left the trust region, and with it the
rare, high-ratio "fork" tokens reasoning depends on. CISPO clips the importance weight instead and
stops its gradient, so every token keeps a REINFORCE gradient scaled by a bounded weight:

    loss_t = -sg(clip(r_t, 1 - eps_clip, 1 + eps_clip_high)) * A_t * log pi(y_t)

Written here as ``-A * sg(clip(r)) * exp(logp - sg(logp))``: the same gradient, and a value equal
to the clipped surrogate's (``-A * clip(r)``), so pg_loss reads like the other losses'. MiniMax-M1
leaves the lower bound open (a large ``eps_clip``) and tunes only the upper one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.common import finish, ratio_of
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings


def cispo_loss(
    inputs: LossInputs,
    settings: LossSettings,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar CISPO loss and detached metrics ("clip_frac": share of tokens whose weight was
    clipped; their gradient is kept, scaled by the clipped weight)."""
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    ratio = ratio_of(inputs.logprobs, inputs.old_logprobs).detach()
    weight = torch.clamp(ratio, 1.0 - settings.eps_clip, 1.0 + settings.eps_clip_high)
    score = torch.exp(inputs.logprobs - inputs.logprobs.detach())  # value 1, gradient grad(logp)
    pg = -inputs.advantages * weight * score
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((weight != ratio).to(pg.dtype), mask),
            "ratio_mean": masked_mean(ratio, mask),
        }
    return finish(inputs, settings, pg, metrics, num_tokens, num_seqs)
