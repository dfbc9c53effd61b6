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

from bench import overhead
from bench.common import add_pin_args

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
    overhead.step_ab(__file__, SIDES, args, "train.deterministic", "deterministic_cost")


if __name__ == "__main__":
    main()
