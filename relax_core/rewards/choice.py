"""The "multiple_choice" reward: one choice letter read from the response, compared with the gold
letter case-insensitively.

Where the letter is looked for, most explicit first: the `Answer:` line ("Answer: C", "Answer: (c)",
"Answer: it is B"), then a parenthesised letter "(C)" anywhere, then the first standalone capital
letter among the valid ones.
Valid letters are A.. up to the number of `sample["choices"]`, or A-E when the row has no choices;
lower-case standalone letters are skipped because "a" is usually the article.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from typing import Any

from relax_core.rewards.extract import answer_line
from relax_core.rewards.result import RewardResult

_DEFAULT_LETTERS = "ABCDE"
_LEADING_LETTER = re.compile(r"\(?([A-Za-z])\)?(?=$|[\s.):,;])")
_PAREN_LETTER = re.compile(r"\(([A-Za-z])\)")
_STANDALONE = re.compile(r"\b([A-Z])\b")


def choice_letters(sample: Mapping[str, Any]) -> str:
    """The valid letters for this row: one per entry of `sample["choices"]`, else A-E."""
    choices = sample.get("choices")
    if not choices:
        return _DEFAULT_LETTERS
    if len(choices) > 26:
        raise ValueError(f"sample 'choices' has {len(choices)} entries; at most 26 can be lettered")
    return string.ascii_uppercase[: len(choices)]


def _find_letter(text: str, letters: str) -> str | None:
    for m in _PAREN_LETTER.finditer(text):
        if m.group(1).upper() in letters:
            return m.group(1).upper()
    for m in _STANDALONE.finditer(text):
        if m.group(1) in letters:
            return m.group(1)
    return None


def extract_choice(response: str, letters: str) -> str | None:
    """The upper-case letter the response picks from `letters`, or None. Inside an `Answer:` line
    first (where "Answer: c" counts), then anywhere in the response."""
    line = answer_line(response)
    if line is not None:
        m = _LEADING_LETTER.match(line)
        if m and m.group(1).upper() in letters:
            return m.group(1).upper()
        found = _find_letter(line, letters)
        if found is not None:
            return found
    return _find_letter(response, letters)


def choice_reward(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    """1.0 if the extracted letter equals `answer` (a letter), else 0.0.
    info: {"extracted": the letter, or "" if none was found}."""
    letters = choice_letters(sample)
    gold = answer.strip().strip("()").upper()
    if len(gold) != 1 or gold not in letters:
        raise ValueError(
            f"multiple_choice answer must be one of the letters {letters}, got {answer!r}"
        )
    picked = extract_choice(response, letters)
    correct = picked == gold
    return RewardResult(1.0 if correct else 0.0, correct, {"extracted": picked or ""})
