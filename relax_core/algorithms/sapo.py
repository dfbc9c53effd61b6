"""SAPO: a soft, sigmoid gate on the ratio instead of PPO's hard clip.

``f(r) = (4 / tau) * sigmoid(tau * (r - 1))``, loss ``-f(r) * A`` per token, with ``tau_pos`` for
positive and ``tau_neg`` for negative advantages. ``f'(1) = 1``, so on-policy it is the plain
policy gradient; far from r = 1 the gradient fades smoothly (``4 s (1 - s) r``) instead of
dropping to zero at a clip boundary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax_core.algorithms.aggregation import masked_mean
from relax_core.algorithms.common import finish, ratio_of
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.settings import LossSettings


def sapo_gate(ratio: Tensor, advantages: Tensor, tau_pos: float, tau_neg: float) -> Tensor:
    """f(r) per token [B, T]."""
    tau = torch.where(
        advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg)
    )
    return (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))


def sapo_loss(
    inputs: LossInputs,
    settings: LossSettings,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Scalar SAPO loss; metrics add "gate_mean", the mean gradient scale 4 s (1 - s)."""
    inputs = inputs.zero_padding()
    mask = inputs.loss_mask
    ratio = ratio_of(inputs.logprobs, inputs.old_logprobs)
    gate = sapo_gate(ratio, inputs.advantages, settings.sapo_tau_pos, settings.sapo_tau_neg)
    pg = -gate * inputs.advantages
    with torch.no_grad():
        tau = torch.where(inputs.advantages > 0, settings.sapo_tau_pos, settings.sapo_tau_neg)
        s = torch.sigmoid(tau * (ratio - 1.0))
        metrics = {
            "ratio_mean": masked_mean(ratio, mask),
            "gate_mean": masked_mean(4.0 * s * (1.0 - s), mask),
        }
    return finish(inputs, settings, pg, metrics, num_tokens, num_seqs)
