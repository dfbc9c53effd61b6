"""DAPO's sampling-side pieces: which groups carry a learning signal, and the soft overlong
penalty on rewards."""

from __future__ import annotations

from collections.abc import Sequence


def has_signal(rewards: Sequence[float], tol: float = 1e-9) -> bool:
    """Whether a group's rewards differ: equal rewards give every sample advantage 0."""
    return len(rewards) > 1 and max(rewards) - min(rewards) > tol


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, penalty: float) -> float:
    """Reward to subtract from a response of `length` tokens (DAPO's soft overlong punishment).

    0 up to ``max_new_tokens - buffer`` tokens, then rising linearly to ``penalty`` at
    ``max_new_tokens``: e.g. budget 16, buffer 4, penalty 1 -> 13 tokens cost 0.25, 16 cost 1.
    """
    if buffer <= 0:
        return 0.0
    if not 0 < buffer < max_new_tokens:
        raise ValueError(f"buffer must be in (0, {max_new_tokens}), got {buffer}")
    over = length - (max_new_tokens - buffer)
    return penalty * min(1.0, max(0.0, over / buffer))
