"""What `train.deterministic` costs: the CPU default's colocate step with the knob on and off.

Each round runs one A/B pair, the order alternating from round to round; every run is a fresh
process pinned to one CPU set with one thread budget (bench.common.run_worker) that builds the
CPU default's colocate controller (bench/overhead.py's engine side) from the cached policy with
the knob on or off, takes `--warmup` untimed steps and times `--steps` steps. The two sides sample
alike only until the first update, so their trajectories part; over 40 steps the per-step work is
the same on average (32 prompts x 8 samples of up to 4 tokens).

    python bench/deterministic_cost.py [--rounds 5] [--steps 40] [--warmup 3] [--cpus 0,1]
        [--threads 2]

Last line: `headline: deterministic_cost = X`, the median over pairs of s/step with the knob on
over s/step with it off. The CPU configs keep it on while that stays under 1.10.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import shutil
import statistics
import tempfile

from bench import overhead
from bench.common import add_pin_args, cpu_set, median_range, prepared_policy, run_worker

SIDES = ("on", "off")


def worker(side: str, steps: int, warmup: int) -> None:
    """bench/overhead.py's engine worker with the knob on or off."""
    overhead.worker("engine", steps, warmup, train={"deterministic": side == "on"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    add_pin_args(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup)
    cpus = cpu_set(args.cpus)
    work = tempfile.mkdtemp(prefix="relax-determinism-")
    prepared_policy(overhead.bench_config(work))  # the warm start once, here, so no worker times it
    shutil.rmtree(work, ignore_errors=True)
    per_step: dict[str, list[float]] = {side: [] for side in SIDES}
    ratios = []
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", side]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            per_step[side].append(run_worker(cmd, cpus, args.threads)["s_per_step"])
        ratios.append(per_step["on"][-1] / per_step["off"][-1])
        print(f"round {r + 1}: on {per_step['on'][-1]:.4f} s/step, off "
              f"{per_step['off'][-1]:.4f} s/step, on / off {ratios[-1]:.3f}", flush=True)  # fmt: skip
    print(f"\nCPUs {cpus}; {args.threads} torch threads per process; {args.steps} timed steps "
          f"after {args.warmup}; {args.rounds} rounds, the order alternating")  # fmt: skip
    for side in SIDES:
        print(f"train.deterministic {side}: {median_range(per_step[side], 4)} s/step")
    print(f"on / off per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"headline: deterministic_cost = {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
