"""Reward names a config may use, and resolving a config's `reward` section to a reward.

`resolve_reward(name)` gives a per-sample function and needs nothing but the name; "genrm" (a
model judge) needs its judge settings and a loaded model, so a run builds its reward with
`build_reward(cfg.reward, ...)`, and `check_reward(cfg.reward)` validates either kind up front.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relax_core.config import RewardConfig
from relax_core.config.checks import judge_problems
from relax_core.rewards.choice import choice_reward
from relax_core.rewards.digits import digits_reward
from relax_core.rewards.f1 import f1_reward
from relax_core.rewards.math import math_reward
from relax_core.rewards.result import BatchRewardFn, RewardFn, RewardResult
from relax_core.rewards.user import load_user_reward

REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "digits": digits_reward,
    "multiple_choice": choice_reward,
    "f1": f1_reward,
}
GENRM = "genrm"
"""The model-judge reward (relax_core.rewards.genrm), built by `build_reward`."""


def genrm_unbuilt(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    """What `resolve_reward("genrm")` returns: the name is valid, but scoring needs the judge
    model, which only `build_reward` loads."""
    raise RuntimeError(
        "reward 'genrm' needs its judge model; build it with "
        "relax_core.rewards.registry.build_reward(cfg.reward, ...), not resolve_reward"
    )


def resolve_reward(name: str) -> RewardFn:
    """A registered reward by name, or a user function written "module:function" (imported now,
        so a typo fails at config validation, not mid-run). Raises ValueError (unknown name, module
    or attribute) or TypeError (not a 3-argument callable), each naming the problem."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in REWARDS:
        return REWARDS[name]
    if name == GENRM:
        return genrm_unbuilt
    if ":" in name:
        return load_user_reward(name)
    raise ValueError(
        f"unknown reward {name!r}; registered rewards: {', '.join(sorted(REWARDS))}; "
        f"model judge: {GENRM!r} (see reward.judge_*); "
        "a user function is given as 'module:function' (e.g. 'my_pkg.rewards:score')"
    )


def check_reward(cfg: RewardConfig) -> None:
    """Everything about `cfg` that can be checked without loading a model: the name (as
    `resolve_reward`) and, for "genrm", the judge settings and that `judge_source` exists.
    Raises ValueError or TypeError naming the field."""
    resolve_reward(cfg.name)
    if cfg.name.strip() != GENRM:
        return
    from relax_core.models.pretrained import resolve_source
    from relax_core.rewards.genrm import check_template

    check_template(cfg.judge_template)
    problems = judge_problems(cfg)
    if problems:
        raise ValueError("; ".join(problems))
    try:
        resolve_source(cfg.judge_source)
    except (OSError, ImportError) as e:
        raise ValueError(f"reward.judge_source: {e}") from e


def build_reward(
    cfg: RewardConfig, cache_dir: str | None = None, dtype: str = "float32", seed: int = 0
) -> RewardFn | BatchRewardFn:
    """The run's reward: a loaded GenRM judge for "genrm" (see `build_genrm_judge` for
    `cache_dir`, `dtype`, `seed`), else `resolve_reward(cfg.name)`."""
    if cfg.name.strip() != GENRM:
        return resolve_reward(cfg.name)
    check_reward(cfg)
    from relax_core.rewards.genrm import build_genrm_judge

    return build_genrm_judge(cfg, cache_dir=cache_dir, dtype=dtype, seed=seed)
