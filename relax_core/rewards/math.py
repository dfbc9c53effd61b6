"""The "math" reward: the final answer (an `Answer:` line, a bare number, or `\\boxed{}`) is
compared with the gold answer, numerically when both are plain numbers (or, for a numeric gold
answer, with the last number of a response that has no `Answer:` line), else with math-verify.

math-verify is imported lazily: it pulls in sympy (about a second), which a run whose answers are
all numbers never needs. Its default timeout uses `signal.alarm`, which raises when called off the
main thread; rollout may score from a thread pool, so the timeout is only used on the main thread.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from relax_core.rewards.extract import clip, final_answer, last_boxed
from relax_core.rewards.result import RewardResult

# Thousands separators are accepted only in proper groups of three ("1,234,567"), so a list such
# as "1,2" is not read as the number 12.
_GROUPED = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")
_PLAIN = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_IN_TEXT = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[+-]?\d+(?:\.\d+)?")
# Relative tolerance for non-integer answers; integers are compared exactly (1000000 != 1000001).
_REL_TOL = 1e-6
_VERIFY_TIMEOUT_S = 5


def parse_number(text: str) -> Decimal | None:
    """`text` as a number if it is a plain decimal ("-3", "46.0", "1,234", "$12$", "7."), else
    None (fractions, LaTeX, words)."""
    s = text.strip().strip("$").strip()
    s = s.removesuffix(".")
    if _GROUPED.fullmatch(s):
        s = s.replace(",", "")
    elif not _PLAIN.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def numbers_equal(a: Decimal, b: Decimal) -> bool:
    """Exact equality for integers, relative tolerance otherwise."""
    if a == a.to_integral_value() and b == b.to_integral_value():
        return a == b
    return math.isclose(float(a), float(b), rel_tol=_REL_TOL, abs_tol=1e-12)


def _mv_parse(text: str, timeout_s: int | None) -> list[Any]:
    from math_verify import parse

    # Bare LaTeX must sit in math delimiters: undelimited, "2\sqrt{2}" parses as 2 and
    # "\sqrt{8}" as nothing. Prose and plain numbers parse best as they are.
    wrapped = f"${text}$"
    first, second = (wrapped, text) if "\\" in text and "$" not in text else (text, wrapped)
    parsed = parse(first, parsing_timeout=timeout_s)
    if not parsed and "$" not in text:
        parsed = parse(second, parsing_timeout=timeout_s)
    return parsed


def symbolic_equal(extracted: str, gold: str) -> bool:
    """math-verify's equivalence of two answers (fractions, LaTeX, expressions)."""
    from math_verify import verify

    on_main = threading.current_thread() is threading.main_thread()
    timeout_s = _VERIFY_TIMEOUT_S if on_main else None
    gold_parsed = _mv_parse(gold, timeout_s)
    pred_parsed = _mv_parse(extracted, timeout_s)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))


def math_reward(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    """1.0 if the response's final answer equals `answer` (numerically or symbolically), else 0.0.
    info: {"extracted": the answer read from the response, "method": how it was compared}."""
    extracted = final_answer(response)
    gold_boxed = last_boxed(answer)
    gold = (gold_boxed if gold_boxed is not None else answer).strip()
    if not extracted:
        return RewardResult(0.0, False, {"extracted": "", "method": "empty"})
    got, want = parse_number(extracted), parse_number(gold)
    if got is not None and want is not None:
        correct = numbers_equal(got, want)
        method = "numeric"
    elif want is not None:
        # A numeric gold answer and a wordy response without an Answer: line: the response's
        # last number is its answer. Checked directly, since math-verify spends up to seconds
        # parsing prose and a chatty model writes a lot of it.
        numbers = _IN_TEXT.findall(extracted)
        last = parse_number(numbers[-1]) if numbers else None
        correct = last is not None and numbers_equal(last, want)
        method = "last_number"
    else:
        correct = symbolic_equal(extracted, gold)
        method = "math_verify"
    info = {"extracted": clip(extracted), "method": method}
    return RewardResult(1.0 if correct else 0.0, correct, info)
