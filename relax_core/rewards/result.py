"""The value every reward function returns, and the shape of a reward function."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class RewardResult:
    """One sample's score."""

    reward: float
    """Scalar reward fed to the advantage estimator."""
    correct: bool
    """Whether the response counts as correct (drives the accuracy metric)."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable details (e.g. the extracted answer), stored in the row's `reward_info`."""


class RewardFn(Protocol):
    """`fn(response, answer, sample) -> RewardResult`; `sample` is the dataset row
    (keys "prompt", "answer", "meta", optionally "choices")."""

    def __call__(
        self, response: str, answer: str, sample: Mapping[str, Any], /
    ) -> RewardResult: ...
