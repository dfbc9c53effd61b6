"""The "math" reward against math-verify used alone, on the hand-labelled table of
tests/unit/test_math_reward_table.py (plain numbers, prose, `Answer:` lines, boxed LaTeX,
scientific notation, units, percent, tuples, intervals, sets, LaTeX gold answers, adversarial
text).

For each case: the label, our verdict (the registry's "math" reward, as a run calls it) and
math-verify's as the plain library is used, `verify(parse(gold), parse(response))` with its
defaults. One line per case where the two differ, then the counts.

    python bench/math_reward.py

Last line: `headline: math_agreement = X/N (math-verify K/N)` (cases where each verdict matches
the label). Not a timing benchmark: the verdicts are deterministic, so there are no A/B rounds
and machine load does not matter.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue`: put the repo there instead (the table lives in tests/).
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

from relax_core.rewards import resolve_reward  # noqa: E402
from tests.unit.test_math_reward_table import ROW, agreement  # noqa: E402


def _mark(verdict: bool, label: bool) -> str:
    return f"{'correct' if verdict else 'wrong'}{'' if verdict == label else ' (X)'}"


def main() -> None:
    ok, mv_ok, rows = agreement()
    n = len(rows)
    reward = resolve_reward("math")
    print("cases where ours and math-verify alone differ ((X): disagrees with the label)")
    print(f"{'response':<44} {'gold':<18} {'label':<8} {'ours':<12} {'method':<12} math-verify")
    for response, gold, label, ours, mv in rows:
        if ours == mv:
            continue
        method = reward(response, gold, ROW).info["method"]
        print(
            f"{response!r:<44} {gold!r:<18} {'correct' if label else 'wrong':<8} "
            f"{_mark(ours, label):<12} {method:<12} {_mark(mv, label)}"
        )
    print(f"ours {ok}/{n}, math-verify alone {mv_ok}/{n}")
    print(f"headline: math_agreement = {ok}/{n} (math-verify {mv_ok}/{n})")


if __name__ == "__main__":
    main()
