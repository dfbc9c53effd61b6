"""Where the suite's time goes: each test file's total from a pytest junit XML report (setup,
call and teardown of its tests, module fixtures included), slowest first, then the sum.

    python scripts/durations.py junit.xml [--top 25] [--write tests/file_times.json]

scripts/test.sh prints it after every run, so CI's log keeps the numbers the next contributor
re-ranks the suite's costs on. `--write` saves every file's seconds as JSON: tests/conftest.py
hands the two workers the slowest files first from tests/file_times.json, so no heavy file is
left to run alone at the end (refresh it from a whole-suite run when the costs move).
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET


def file_times(path: str) -> dict[str, tuple[float, int]]:
    """Test file -> (seconds, tests) from a junit XML report (xunit1 or xunit2)."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for case in ET.parse(path).getroot().iter("testcase"):
        where = case.get("file") or case.get("classname", "?").rsplit(".", 1)[0].replace(".", "/")
        if not where.endswith(".py"):
            where += ".py"
        totals[where][0] += float(case.get("time") or 0.0)
        totals[where][1] += 1
    return {name: (t, int(n)) for name, (t, n) in totals.items()}


def outcomes(path: str) -> tuple[int, int, int]:
    """(passed, failed or errored, skipped) test cases in a junit XML report."""
    passed = failed = skipped = 0
    for case in ET.parse(path).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            failed += 1
        elif "skipped" in kinds:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--elapsed", type=float, help="the run's wall-clock seconds, to print")
    parser.add_argument("--write", metavar="JSON", help="save each file's seconds here")
    args = parser.parse_args()
    times = sorted(file_times(args.report).items(), key=lambda kv: -kv[1][0])
    if args.write:
        with open(args.write, "w") as f:
            json.dump({name: round(t, 1) for name, (t, _) in times}, f, indent=0)
            f.write("\n")
    total = sum(t for _, (t, _) in times)
    print(f"\n==== time per test file (top {args.top} of {len(times)}) ====")
    for name, (seconds, count) in times[: args.top]:
        print(f"{seconds:8.1f} s {100 * seconds / max(total, 1e-9):5.1f}% {count:5d} tests  {name}")
    print(f"{total:8.1f} s in all, summed over the workers")
    if args.elapsed is not None:
        print(f"tests: wall-clock {args.elapsed:.0f} s")
    passed, failed, skipped = outcomes(args.report)
    print(f"tests: {passed} passed, {failed} failed, {skipped} skipped")


if __name__ == "__main__":
    main()
