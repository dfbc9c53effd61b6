"""Reward functions: `fn(response, answer, sample) -> RewardResult`, looked up by name (or a user's
"module:function") with `resolve_reward`, and applied to a batch with `score_batch`.

May import: config, data, models, rollout.
"""

from relax_core.rewards.registry import REWARDS, resolve_reward
from relax_core.rewards.result import RewardFn, RewardResult
from relax_core.rewards.scoring import score_batch

__all__ = ["REWARDS", "RewardFn", "RewardResult", "resolve_reward", "score_batch"]
