"""The "f1" reward: token-level F1 between the normalised final answer and the gold answer
(reading-comprehension style: lower-case, no punctuation, no articles, whitespace tokens)."""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Mapping
from typing import Any

from relax_core.rewards.extract import answer_line, clip
from relax_core.rewards.result import RewardResult

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalise_tokens(text: str) -> list[str]:
    """Lower-cased tokens of `text` with punctuation and the articles a/an/the removed."""
    text = text.lower().translate(_PUNCT)
    return _ARTICLES.sub(" ", text).split()


def token_f1(prediction: str, gold: str) -> float:
    """Harmonic mean of token precision and recall; 1.0 when both normalise to nothing."""
    pred, ref = normalise_tokens(prediction), normalise_tokens(gold)
    if not pred or not ref:
        return float(pred == ref)
    overlap = sum((Counter(pred) & Counter(ref)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_reward(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    """reward = token F1 in [0, 1] of the response's `Answer:` line (or the whole response if it
    has none) against `answer`; correct only for F1 == 1. info: {"extracted": compared text}."""
    line = answer_line(response)
    prediction = line if line is not None else response.strip()
    f1 = token_f1(prediction, answer)
    return RewardResult(f1, f1 == 1.0, {"extracted": clip(prediction)})
