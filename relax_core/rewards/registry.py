"""Reward names a config may use, and resolving a config's `reward` field to a function."""

from __future__ import annotations

from relax_core.rewards.choice import choice_reward
from relax_core.rewards.digits import digits_reward
from relax_core.rewards.f1 import f1_reward
from relax_core.rewards.math import math_reward
from relax_core.rewards.result import RewardFn
from relax_core.rewards.user import load_user_reward

REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "digits": digits_reward,
    "multiple_choice": choice_reward,
    "f1": f1_reward,
}


def resolve_reward(name: str) -> RewardFn:
    """A registered reward by name, or a user function written "module:function" (imported now,
        so a typo fails at config validation, not mid-run). Raises ValueError (unknown name, module
    or attribute) or TypeError (not a 3-argument callable), each naming the problem."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        return load_user_reward(name)
    raise ValueError(
        f"unknown reward {name!r}; registered rewards: {', '.join(sorted(REWARDS))}; "
        "a user function is given as 'module:function' (e.g. 'my_pkg.rewards:score')"
    )
