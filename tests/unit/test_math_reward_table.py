r"""The "math" reward against a hand-labelled table of responses and gold answers, and against
math-verify used alone as the plain library is (`verify(parse(gold), parse(response))`).

Every label is what a careful grader would say; a comment gives the reason where it is not
obvious. The reward must match every label and must never be wrong where math-verify alone is
right. bench/math_reward.py prints the same comparison (`python -m pytest -s` prints the counts).
"""

from __future__ import annotations

import pytest

from relax_core.rewards import resolve_reward

ROW = {"prompt": "p", "answer": "a", "meta": {}}

# (response, gold answer, correct)
CASES: list[tuple[str, str, bool]] = [
    # plain numbers
    ("46", "46", True),
    ("46.0", "46", True),
    ("45", "46", False),
    ("1000001", "1000000", False),  # integers compare exactly
    ("3.14159", "3.1416", False),  # 1.3e-6 apart relatively: beyond the 1e-6 tolerance
    ("1,2", "12", False),  # a list, not a thousands separator
    # prose: its last number is its answer
    ("8 + 2 = 10, so there are 10 apples.", "10", True),
    ("I think it is 12, or maybe 13", "12", False),
    ("The total is 1,234 dollars", "1234", True),
    # Answer: lines (the last one counts)
    ("Adding them up.\nAnswer: 7", "7", True),
    ("Answer: 3\nAnswer: 4", "3", False),
    ("**Answer:** $\\frac{3}{4}$", "0.75", True),
    # boxed fractions, roots, powers
    ("so \\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{\\dfrac{3}{6}}", "0.5", True),
    ("\\boxed{\\tfrac12}", "0.5", True),
    ("\\boxed{\\frac{1}{3}}", "0.5", False),
    ("\\boxed{-\\frac{3}{4}}", "-0.75", True),
    ("\\boxed{\\frac{3}{4}}", "-0.75", False),  # the sign matters
    ("\\boxed{2\\frac{1}{2}}", "2.5", True),  # a mixed number (math-verify reads 2 * 1/2)
    ("\\boxed{\\sqrt{4}}", "2", True),
    ("\\boxed{\\sqrt{5}}", "2", False),
    ("\\boxed{\\sqrt[3]{27}}", "3", True),
    ("\\boxed{2^{10}}", "1024", True),
    ("\\boxed{2^{3}}", "3", False),  # 8; its last number, 3, must not count
    # Arithmetic left to do is not an answer to a numeric question: on "23+45=" a policy that
    # echoes the question would otherwise be paid for it (the last-number rule judges these).
    ("\\boxed{3 \\cdot 4}", "12", False),
    ("23+45", "68", False),
    ("Answer: 23+45", "68", False),
    ("23+45=68", "68", True),
    ("1.5\\times10^{3}", "1500", True),  # scientific notation is a value
    ("\\boxed{2\\sqrt{2}}", "2.828427125", True),  # 2.8284271247...: within 1e-6
    ("\\boxed{\\binom{5}{2}}", "10", True),
    # pi
    ("\\boxed{2\\pi}", "6.283185307", True),
    ("\\boxed{2\\pi}", "6.28", False),  # 5e-4 off: a rounded value is not the answer
    # scientific notation and thousands separators
    ("1e3", "1000", True),
    ("\\boxed{1.5\\times10^{3}}", "1500", True),
    ("Answer: 1.5 \\times 10^{-3}", "0.0015", True),
    ("\\boxed{1.5\\times10^{4}}", "1500", False),
    ("\\boxed{1{,}000}", "1000", True),
    ("\\boxed{1\\,000\\,000}", "1000000", True),
    # units around the number
    ("\\boxed{12\\text{ cm}}", "12", True),
    ("\\boxed{30^\\circ}", "30", True),
    ("\\boxed{\\$12}", "12", True),
    ("\\boxed{13\\text{ cm}}", "12", False),
    # percent: X\% is X (the sign as a unit) or X/100 (see relax_core/rewards/math.py)
    ("\\boxed{50\\%}", "0.5", True),
    ("\\boxed{50\\%}", "50", True),
    ("\\boxed{12.5\\%}", "12.5", True),  # math-verify accepts the unit reading only for integers
    ("\\boxed{5\\%}", "0.5", False),  # 5% is 0.05
    # negative numbers
    ("\\boxed{-5}", "-5", True),
    ("Answer: -5", "5", False),
    ("\\boxed{x = -5}", "-5", True),  # the right-hand side of a solved equation
    # tuples: ordered, element-wise
    ("\\boxed{\\left(1,2\\right)}", "(1, 2)", True),
    ("\\boxed{(1,\\frac{4}{2})}", "(1, 2)", True),
    ("\\boxed{(2,1)}", "(1, 2)", False),
    ("\\boxed{1, 2}", "(1, 2)", False),  # a bare list is a set of solutions, not a point
    ("The point is $(1, 2)$.", "(1, 2)", True),
    # intervals: the ends must match open/closed
    ("\\boxed{[0,1)}", "[0, 1)", True),
    ("\\boxed{(0,1)}", "[0,1]", False),
    ("\\boxed{(0, \\infty)}", "(0, \\infty)", True),
    ("\\boxed{[0, \\infty)}", "(0, \\infty)", False),
    # sets and lists of solutions: any order
    ("\\boxed{\\{2, 1\\}}", "\\{1, 2\\}", True),
    ("\\boxed{3, 1, 2}", "1, 2, 3", True),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2, 3\\}", False),
    # LaTeX gold answers
    ("\\boxed{\\frac{\\pi}{2}}", "\\frac{\\pi}{2}", True),
    ("\\boxed{\\frac{2\\pi}{4}}", "\\frac{\\pi}{2}", True),
    ("\\boxed{1.5707963}", "\\frac{\\pi}{2}", True),  # 2e-8 off relatively: within 1e-6
    ("\\boxed{1.5708}", "\\frac{\\pi}{2}", False),  # 2.3e-6 off: beyond 1e-6
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("Answer: \\sqrt{8}", "2\\sqrt{2}", True),
    ("Answer: 2\\sqrt{3}", "2\\sqrt{2}", False),
    ("\\boxed{x^2+1}", "1+x^2", True),
    ("\\boxed{x^2-1}", "x^2+1", False),
    # adversarial text
    ("\\boxed{3} no wait, \\boxed{4}", "4", True),  # the last \boxed{} counts
    ("\\boxed{3} no wait, \\boxed{4}", "3", False),
    ("So the probability is $\\frac{1}{2}$.", "0.5", True),  # prose: its last math
    ("\\boxed{10^{10^{5}}}", "10", False),  # too large to compute here: never 10
    ("\\boxed{\\frac{1}{0}}", "0", False),  # undefined, not "its last number is 0"
    ("\\boxed{\\text{no solution}}", "0", False),
    ("\\boxed{}", "0", False),
    ("\\boxed{\\frac{1}{2}}? No: \\boxed{\\frac{1}{3}}", "0.5", False),  # the last box counts
    ("Answer: 12 or 13", "12", False),  # a hedge: its last number is what it commits to
    ("}}}{{{\\frac{\\sqrt[", "1", False),  # junk: scores 0, never raises
]


def ours(response: str, gold: str) -> bool:
    """The reward's verdict, called as the registry's "math" entry is called during a run."""
    return resolve_reward("math")(response, gold, ROW).correct


def math_verify_alone(response: str, gold: str) -> bool:
    """math-verify as the plain library is used; any error counts as a wrong verdict."""
    from math_verify import parse, verify

    try:
        return bool(verify(parse(gold), parse(response)))
    except Exception:
        return False


def agreement() -> tuple[int, int, list[tuple[str, str, bool, bool, bool]]]:
    """(cases ours gets right, cases math-verify alone gets right, every case with both
    verdicts: (response, gold, label, ours, math-verify))."""
    rows = [(r, g, label, ours(r, g), math_verify_alone(r, g)) for r, g, label in CASES]
    return (
        sum(o == label for _, _, label, o, _ in rows),
        sum(m == label for _, _, label, _, m in rows),
        rows,
    )


def test_the_table_is_big_enough_and_unique():
    assert len(CASES) >= 40
    assert len({(r, g) for r, g, _ in CASES}) == len(CASES)


@pytest.mark.parametrize(("response", "gold", "correct"), CASES)
def test_math_reward_matches_the_label(response, gold, correct):
    assert ours(response, gold) is correct


def test_never_worse_than_math_verify_alone():
    ok, mv_ok, rows = agreement()
    n = len(rows)
    print(f"\nmath reward table: ours {ok}/{n}, math-verify alone {mv_ok}/{n}")
    worse = [(r, g) for r, g, label, o, m in rows if m == label and o != label]
    assert not worse, f"math-verify alone is right and ours is not on {worse}"
    assert ok == n
