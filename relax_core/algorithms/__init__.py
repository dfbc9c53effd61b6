"""Pure tensor functions for RL post-training: advantages, policy losses, KL, aggregation.

Config names map to functions through the plain dicts below; each policy loss takes one
``LossInputs`` and keyword settings and returns ``(scalar loss, detached metrics)``.
"""

from relax_core.algorithms.advantages import broadcast_to_tokens, grpo_advantages
from relax_core.algorithms.aggregation import AGGREGATIONS, aggregate
from relax_core.algorithms.grpo import grpo_loss
from relax_core.algorithms.inputs import LossInputs
from relax_core.algorithms.kl import KL_ESTIMATORS, kl_penalty

POLICY_LOSSES = {"grpo": grpo_loss}
ADVANTAGE_ESTIMATORS = {"grpo": grpo_advantages}

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "LossInputs",
    "aggregate",
    "broadcast_to_tokens",
    "grpo_advantages",
    "grpo_loss",
    "kl_penalty",
]
