"""User reward functions for tests/unit/test_rewards.py, loaded as "tests.unit.reward_fixtures:..."."""

from relax_core.rewards import RewardResult

NOT_A_FUNCTION = 42


def length_reward(response, answer, sample):
    """A well-behaved user reward: 1.0 for responses of at most 5 characters."""
    ok = len(response) <= 5
    return RewardResult(1.0 if ok else 0.0, ok, {"length": len(response)})


def raises_on_x(response, answer, sample):
    """Fails for responses containing "x", scores the rest 1.0."""
    if "x" in response:
        raise RuntimeError(f"cannot score {response!r}")
    return RewardResult(1.0, True, {})


def nan_reward(response, answer, sample):
    return RewardResult(float("nan"), False, {})


def string_reward(response, answer, sample):
    return RewardResult("1.0", True, {})


def returns_float(response, answer, sample):
    return 1.0


def unserialisable_info(response, answer, sample):
    return RewardResult(1.0, True, {"obj": object()})


def two_args(response, answer):
    return RewardResult(0.0, False, {})
