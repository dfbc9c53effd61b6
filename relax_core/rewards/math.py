r"""The "math" reward: the final answer (an `Answer:` line, a bare number, or `\boxed{}`) is
compared with the gold answer
- numerically when both are plain numbers;
- by reading both as numbers, tuples, intervals or sets (relax_core.rewards.math_symbolic reads
  `\frac{1}{2}`, `\sqrt{4}`, `1e3`, `12\text{ cm}`, `[0, 1)`) when the gold answer is a plain
  number or such a group and the response's answer reads that way;
- with math-verify (`math_verify.parse`, `math_verify.verify`) for any other gold answer
  (`\frac{\pi}{2}`, `x^2+1`), that reading being a second opinion for what math-verify's parser
  misses, and for a group the response's answer does not read as;
- for a numeric gold answer and a response that does not read as math (prose), with the last
  number of the response.
Text that nothing reads scores 0; the reward never raises.

Read answers compare by `numbers_equal` (integers exactly, other numbers to a relative 1e-6, so
1.5707963 matches `\frac{\pi}{2}` and 1.5708 does not), and by math-verify's (0.9.0) conventions
where they are clear:
- percent: `X\%` equals X (the sign read as a unit) and X/100. math-verify's `verify` accepts
  both for whole percentages (9% = 9, 50% = 0.5) but only X/100 for decimals; here 12.5\% also
  equals 12.5, since a "what percent" question's gold answer is usually written without the sign.
- sets (`\{1, 2\}`) and bare lists (`1, 2`, how "find all solutions" answers are written) are
  unordered and equal to each other; tuples and intervals are ordered and their brackets must
  match, so `(1, 2)` is neither `[1, 2]`, `(2, 1)` nor `1, 2` (math-verify in strict mode does not
  compare sets with tuples either).

math-verify is imported lazily: it pulls in sympy (about a second), which a run whose answers are
all numbers never needs. Its default timeout uses `signal.alarm`, which raises when called off the
main thread; rollout may score from a thread pool, so the timeout is only used on the main thread.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation, localcontext
from typing import Any

from relax_core.rewards.extract import clip, final_answer, last_boxed
from relax_core.rewards.math_symbolic import (
    MAX_CHARS,
    RELATIONS,
    TEXT_GROUP,
    Answer,
    Group,
    Scalar,
    Value,
    normalise,
    read_answer,
    top_level,
)
from relax_core.rewards.result import RewardResult

# Thousands separators are accepted only in proper groups of three ("1,234,567"), so a list such
# as "1,2" is not read as the number 12.
_GROUPED = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")
_PLAIN = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
_IN_TEXT = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[+-]?\d+(?:\.\d+)?")
_VERIFY_TIMEOUT_S = 5
# Relative tolerance for non-integer answers; integers are compared exactly (1000000 != 1000001).
_REL_TOL = 1e-6
_MATH_SEGMENT = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_WORD = re.compile(r"[A-Za-z]{2,}")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_DIGIT = re.compile(r"\d")
# Longer prose is left to the last-number rule: finding its math segments costs more per response.
_MAX_PROSE_CHARS = 20 * MAX_CHARS


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
    if not (a.is_finite() and b.is_finite()):  # an interval's \infty; NaN equals nothing
        return a == b
    if a == a.to_integral_value() and b == b.to_integral_value():
        return a == b
    return math.isclose(float(a), float(b), rel_tol=_REL_TOL, abs_tol=1e-12)


def _decimal(v: Value) -> Decimal:
    if isinstance(v, float):
        return Decimal(v)
    if v.denominator == 1:
        return Decimal(v.numerator)
    with localcontext() as ctx:
        ctx.prec = 40
        return Decimal(v.numerator) / Decimal(v.denominator)


def _is_nan(v: Value) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _values_equal(a: Value, b: Value) -> bool:
    if _is_nan(a) or _is_nan(b):
        return False
    try:
        return numbers_equal(_decimal(a), _decimal(b))
    except (ArithmeticError, ValueError):
        return False


def _scalars_equal(a: Scalar, b: Scalar) -> bool:
    if _values_equal(a.value, b.value):
        return True
    if a.percent == b.percent:
        return False
    pct, other = (a, b) if a.percent else (b, a)
    return _values_equal(pct.value / 100, other.value)


def _sort_key(s: Scalar) -> float:
    try:
        return float(s.value)
    except OverflowError:
        return math.inf if s.value > 0 else -math.inf


def answers_equal(a: Answer, b: Answer) -> bool:
    """Whether two read answers are equal: numbers by `numbers_equal` (and the percent rule),
    groups element-wise with the same brackets, sets in any order."""
    if isinstance(a, Scalar) and isinstance(b, Scalar):
        return _scalars_equal(a, b)
    if not (isinstance(a, Group) and isinstance(b, Group)):
        return False
    if (a.opener, a.closer) != (b.opener, b.closer) or len(a.items) != len(b.items):
        return False
    xs, ys = a.items, b.items
    if a.opener == "{":
        xs, ys = sorted(xs, key=_sort_key), sorted(ys, key=_sort_key)
    return all(_scalars_equal(x, y) for x, y in zip(xs, ys, strict=True))


def _is_prose(text: str) -> bool:
    return bool(_WORD.search(_COMMAND.sub(" ", TEXT_GROUP.sub(" ", text))))


def answer_expression(extracted: str) -> str | None:
    r"""The part of an extracted answer to read as math: when it has no words, its last line
    (delimiter-only lines such as `$$` skipped); for prose, its last `$...$` (or `\(...\)`,
    `\[...\]`) when no number follows that; else None (prose is left to the reward's
    last-number rule)."""
    if not extracted or len(extracted) > _MAX_PROSE_CHARS:
        return None
    if not _is_prose(extracted):
        # Like the last-number rule, a multi-line answer commits to its last line: "12-\n7" is 7.
        lines = [ln for ln in extracted.splitlines() if ln.strip(" \t$\\[]")]
        return lines[-1] if lines else None
    segments = list(_MATH_SEGMENT.finditer(extracted))
    if not segments or _DIGIT.search(extracted, segments[-1].end()):
        return None
    inner = next(g for g in segments[-1].groups() if g is not None)
    return None if _is_prose(inner) else inner


def _mv_parse(text: str, timeout_s: int | None) -> list[Any]:
    from math_verify import parse

    # Bare math must sit in math delimiters: undelimited, "2\sqrt{2}" parses as 2, "\sqrt{8}" as
    # nothing and "1+x^2" as 1. Prose and plain numbers ("1,234") parse best as they are.
    wrapped = f"${text}$"
    bare_math = "$" not in text and parse_number(text) is None
    bare_math = bare_math and ("\\" in text or not _is_prose(text))
    first, second = (wrapped, text) if bare_math else (text, wrapped)
    parsed = parse(first, parsing_timeout=timeout_s)
    if not parsed and "$" not in text:
        parsed = parse(second, parsing_timeout=timeout_s)
    return parsed


def _mv_verdict(extracted: str, gold: str) -> bool | None:
    """math-verify's verdict, or None when it reads nothing in either text or fails."""
    from math_verify import verify

    on_main = threading.current_thread() is threading.main_thread()
    timeout_s = _VERIFY_TIMEOUT_S if on_main else None
    try:
        gold_parsed = _mv_parse(gold, timeout_s)
        pred_parsed = _mv_parse(extracted, timeout_s)
        if not gold_parsed or not pred_parsed:
            return None
        return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout_s))
    except Exception:  # a scorer must not raise for odd text; math-verify's errors vary
        return None


def symbolic_equal(extracted: str, gold: str) -> bool:
    """math-verify's equivalence of two answers (fractions, LaTeX, expressions)."""
    return bool(_mv_verdict(extracted, gold))


def _last_number_equal(extracted: str, want: Decimal) -> bool:
    # A numeric gold answer and a wordy response without an Answer: line: the response's last
    # number is its answer. Checked directly, since math-verify spends up to seconds parsing
    # prose and a chatty model writes a lot of it.
    numbers = _IN_TEXT.findall(extracted)
    last = parse_number(numbers[-1]) if numbers else None
    return last is not None and numbers_equal(last, want)


_ARITHMETIC = ("+", "-", "*", "\\cdot", "\\times")
_TIMES_TEN = re.compile(r"\s*10\s*\^")


def unevaluated(text: str) -> bool:
    """True when `text` still holds arithmetic to do at its top level ("23+45", "2*8", "12 - 7"),
    not a value: a leading sign, a fraction, a root, a power and `1.5\\times10^{3}` are values.
    Against a numeric gold answer such a response restates its question ("23+45=" asks for 68),
    so it is not read as its value; the last-number rule judges it, as before LaTeX was read."""
    s = normalise(text)
    relations = top_level(s, RELATIONS) or []
    if relations:
        pos, sep = relations[-1]
        s = s[pos + len(sep) :]
    for pos, op in top_level(s, set(_ARITHMETIC)) or []:
        before, after = s[:pos].rstrip(), s[pos + len(op) :]
        if op == "-" and (not before or before.endswith(("e", "E", ","))):
            continue  # a sign, or the exponent of 1e-3
        if op in ("*", "\\cdot", "\\times") and _TIMES_TEN.match(after):
            continue  # scientific notation
        return True
    return False


def _judge(extracted: str, gold: str, want: Decimal | None) -> tuple[bool, str]:
    """(correct, method) for an answer pair that is not two plain numbers; `want` is the gold
    answer as a plain number, if it is one."""
    expr = answer_expression(extracted)
    gold_read = read_answer(gold)
    pred_read = read_answer(expr) if expr is not None else None
    if isinstance(pred_read, Scalar) and _is_nan(pred_read.value):
        # "10^{10^{10}}", "\frac{1}{0}": no value to compare, and sympy could spend minutes (or,
        # off the main thread, without a timeout, forever) evaluating one.
        return False, "latex"
    if want is None and not isinstance(gold_read, Group):
        # A scalar LaTeX gold answer ("\frac{1}{2}", "x^2+1"): math-verify decides as before;
        # reading both as numbers only adds what its parser misses ("\tfrac12", "1{,}000").
        if symbolic_equal(extracted, gold):
            return True, "math_verify"
        if gold_read is not None and pred_read is not None and answers_equal(pred_read, gold_read):
            return True, "latex"
        return False, "math_verify"
    if want is not None and expr is not None and unevaluated(expr):
        pred_read = None
    if pred_read is not None and gold_read is not None:
        # Before the last-number rule, which would take "\sqrt{5}" for 5 and "2^{3}" for 3.
        return answers_equal(pred_read, gold_read), "latex"
    if want is None:
        return symbolic_equal(extracted, gold), "math_verify"
    return _last_number_equal(extracted, want), "last_number"


def math_reward(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    """1.0 if the response's final answer equals `answer` (numerically or symbolically), else 0.0.
    info: {"extracted": the answer read from the response, "method": how it was compared:
    "numeric", "latex", "math_verify", "last_number" or "empty"}."""
    extracted = final_answer(response)
    gold_boxed = last_boxed(answer)
    gold = (gold_boxed if gold_boxed is not None else answer).strip()
    if not extracted:
        return RewardResult(0.0, False, {"extracted": "", "method": "empty"})
    got, want = parse_number(extracted), parse_number(gold)
    if got is not None and want is not None:
        correct, method = numbers_equal(got, want), "numeric"
    else:
        correct, method = _judge(extracted, gold, want)
    info = {"extracted": clip(extracted), "method": method}
    return RewardResult(1.0 if correct else 0.0, correct, info)
