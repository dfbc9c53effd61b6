"""Digit-wise partial credit for integer answers: dense signal for small models learning arithmetic.

An exact answer scores 1 and counts as correct. Otherwise the score is the fraction of the gold
answer's digits that the response has in the same place, aligned from the right (the ones digit
with the ones digit), times 0.5, so no near miss ever outscores a correct answer. A response that
is not an integer scores 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relax_core.rewards.extract import clip, final_answer
from relax_core.rewards.result import RewardResult

NEAR_MISS_WEIGHT = 0.5


def digits_reward(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    got, gold = final_answer(response).strip(), answer.strip()
    if got == gold:
        return RewardResult(1.0, True, {"extracted": clip(got), "digits_right": len(gold)})
    if not (got.lstrip("-").isdigit() and gold.lstrip("-").isdigit()):
        return RewardResult(0.0, False, {"extracted": clip(got), "digits_right": 0})
    right = sum(a == b for a, b in zip(reversed(got), reversed(gold), strict=False))
    score = NEAR_MISS_WEIGHT * right / max(len(gold), len(got))
    return RewardResult(score, False, {"extracted": clip(got), "digits_right": right})
