"""Scoring a batch of responses so that a failing reward function costs samples, never the run:
a sample whose function raises, or returns a non-finite / non-numeric reward or info that is not
JSON, gets reward 0 with the error in its info, and is counted.

A batch reward (one with `score_many`, e.g. the GenRM judge) is called once for the whole batch;
there a raise fails every sample of the batch, and a result carrying `info["error"]` (a sample the
reward itself could not score) is counted as a failure too."""

from __future__ import annotations

import json
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

from relax_core.rewards.result import BatchRewardFn, RewardFn, RewardResult

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
    if not _flat_json(info):
        json.dumps(info)  # raises TypeError naming the first value JSON cannot hold
    return RewardResult(float(reward), bool(result.correct), info)


_JSON_SCALARS = (str, int, float, bool, type(None))


def _flat_json(info: dict) -> bool:
    """Whether `info` is string keys to JSON scalars (what most rewards return), which JSON
    holds without serializing it to find out: a sixth of a tiny model's scoring time."""
    return all(type(k) is str and type(v) in _JSON_SCALARS for k, v in info.items())


def _error_result(e: Exception) -> RewardResult:
    return RewardResult(0.0, False, {"error": f"{type(e).__name__}: {e}"})


def _score_each(fn: RewardFn, responses, answers, samples) -> list[tuple[RewardResult, bool]]:
    """(result, failed) per sample, calling `fn` once per sample."""
    out = []
    for response, answer, sample in zip(responses, answers, samples, strict=True):
        try:
            out.append((_validated(fn(response, answer, sample)), False))
        except Exception as e:  # noqa: BLE001 - a user's reward may raise anything; the run goes on
            out.append((_error_result(e), True))
    return out


def _score_all(fn: BatchRewardFn, responses, answers, samples) -> list[tuple[RewardResult, bool]]:
    """(result, failed) per sample, calling `fn.score_many` once for the batch."""
    try:
        raw = list(fn.score_many(responses, answers, samples))
        if len(raw) != len(responses):
            raise ValueError(
                f"score_many returned {len(raw)} results for {len(responses)} responses"
            )
    except Exception as e:  # noqa: BLE001 - the whole batch fails, the run goes on
        return [(_error_result(e), True)] * len(responses)
    out = []
    for result in raw:
        try:
            checked = _validated(result)
            out.append((checked, "error" in checked.info))
        except Exception as e:  # noqa: BLE001 - one bad result costs its sample only
            out.append((_error_result(e), True))
    return out


def score_batch(
    fn: RewardFn | BatchRewardFn,
    responses: Sequence[str],
    answers: Sequence[str],
    samples: Sequence[Mapping[str, Any]],
) -> tuple[list[RewardResult], int]:
    """Score each (response, answer, sample) with `fn` (in one `fn.score_many` call if `fn` has
    one); returns (results in input order, number of samples whose scoring failed). Failures are
    logged once per batch."""
    if not len(responses) == len(answers) == len(samples):
        raise ValueError(
            f"score_batch needs one answer and one sample per response; got "
            f"{len(responses)} responses, {len(answers)} answers, {len(samples)} samples"
        )
    if callable(getattr(fn, "score_many", None)):
        scored = _score_all(fn, responses, answers, samples)  # type: ignore[arg-type]
    else:
        scored = _score_each(fn, responses, answers, samples)  # type: ignore[arg-type]
    results = [result for result, _ in scored]
    failed = [result for result, bad in scored if bad]
    if failed:
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        logger.warning(
            "reward function %s failed on %d of %d samples (scored 0); first error: %s",
            name,
            len(failed),
            len(responses),
            failed[0].info.get("error"),
        )
    return results, len(failed)
