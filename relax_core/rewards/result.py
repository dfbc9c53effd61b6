"""The value every reward function returns, and the shapes of a reward: per sample (`RewardFn`)
or per batch (`BatchRewardFn`, for rewards such as a model judge that batch their work)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
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


class BatchRewardFn(Protocol):
    """An object that scores a whole batch in one call; `score_batch` prefers it over calling the
    object per sample. A sample it could not score comes back as reward 0 with the reason in
    `info["error"]` and is counted as a failure; raising fails every sample of the batch."""

    def score_many(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        samples: Sequence[Mapping[str, Any]],
        /,
    ) -> list[RewardResult]:
        """One result per response, in input order."""
        ...
