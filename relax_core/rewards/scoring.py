"""Scoring a batch of responses so that a failing reward function costs samples, never the run:
a sample whose function raises, or returns a non-finite / non-numeric reward or info that is not
JSON, gets reward 0 with the error in its info, and is counted."""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core.rewards.result import RewardFn, RewardResult

logger = logging.getLogger(__name__)


def _validated(result: object) -> RewardResult:
    """`result` with plain Python types, or raises TypeError/ValueError saying what is wrong."""
    if not isinstance(result, RewardResult):
        raise TypeError(f"reward function returned {type(result).__name__}, not RewardResult")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        raise TypeError(f"reward must be a real number, got {type(reward).__name__}")
    if not math.isfinite(float(reward)):
        raise ValueError(f"reward must be finite, got {reward}")
    if not isinstance(result.info, Mapping):
        raise TypeError(f"info must be a dict, got {type(result.info).__name__}")
    info = dict(result.info)
    json.dumps(info)  # raises TypeError naming the first value JSON cannot hold
    return RewardResult(float(reward), bool(result.correct), info)


def score_batch(
    fn: RewardFn,
    responses: Sequence[str],
    answers: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
) -> tuple[list[RewardResult], int]:
    """Score each (response, answer, sample) with `fn`; returns (results in input order, number
    of samples whose scoring failed). Failures are logged once per batch."""
    if not len(responses) == len(answers) == len(samples):
        raise ValueError(
            f"score_batch needs one answer and one sample per response; got "
            f"{len(responses)} responses, {len(answers)} answers, {len(samples)} samples"
        )
    results: list[RewardResult] = []
    first_error: str | None = None
    n_errors = 0
    for response, answer, sample in zip(responses, answers, samples, strict=True):
        try:
            results.append(_validated(fn(response, answer, sample)))
        except Exception as e:  # noqa: BLE001 - a user's reward may raise anything; the run goes on
            error = f"{type(e).__name__}: {e}"
            results.append(RewardResult(0.0, False, {"error": error}))
            n_errors += 1
            first_error = first_error or error
    if n_errors:
        name = getattr(fn, "__qualname__", repr(fn))
        logger.warning(
            "reward function %s failed on %d of %d samples (scored 0); first error: %s",
            name,
            n_errors,
            len(responses),
            first_error,
        )
    return results, n_errors
