"""Pure tensor functions for RL post-training: advantages, policy losses, KL, aggregation.

Config names map to functions through the plain dicts below; each policy loss takes one
``LossInputs`` and a ``LossSettings`` and returns ``(scalar loss, detached metrics)``.

May import: nothing of relax_core (torch only).
"""

from relax_core.algorithms.advantages import (
    broadcast_to_tokens,
    grpo_advantages,
    no_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from relax_core.algorithms.aggregation import AGGREGATIONS, aggregate
from relax_core.algorithms.cispo import cispo_loss
from relax_core.algorithms.decoupled import (
    decoupled_ppo_loss,
    interpolate_proximal,
    proximal_alpha,
)
from relax_core.algorithms.distillation import distillation_advantages
from relax_core.algorithms.gmpo import gmpo_loss
from relax_core.algorithms.grpo import grpo_loss
from relax_core.algorithms.gspo import gspo_loss
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.kl import KL_ESTIMATORS, kl_penalty
from relax_core.algorithms.sapo import sapo_loss
from relax_core.algorithms.settings import IS_LEVELS, IS_MODES, SEQ_MASKS, LossSettings

POLICY_LOSSES = {
    "grpo": grpo_loss,
    "gspo": gspo_loss,
    "sapo": sapo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
    "cispo": cispo_loss,
    "gmpo": gmpo_loss,
}
ADVANTAGE_ESTIMATORS = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "none": no_advantages,
}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "IS_LEVELS",
    "IS_MODES",
    "KL_ESTIMATORS",
    "SEQ_MASKS",
    "POLICY_LOSSES",
    "LossInputs",
    "LossSettings",
    "aggregate",
    "broadcast_to_tokens",
    "cispo_loss",
    "decoupled_ppo_loss",
    "distillation_advantages",
    "gmpo_loss",
    "grpo_advantages",
    "grpo_loss",
    "gspo_loss",
    "interpolate_proximal",
    "kl_penalty",
    "proximal_alpha",
    "sapo_loss",
]
