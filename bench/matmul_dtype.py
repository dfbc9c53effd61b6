"""What bf16 matmuls do to a step on this CPU: the CPU default's colocate step with
`model.matmul_dtype` bfloat16 against float32 ('').

Whether bf16 pays depends on the CPU: with native bf16 (AVX512-BF16, AMX) its linear layers run
faster than float32 ones; on an AVX2-only CPU torch converts around every product and they run
many times slower. `model.matmul_dtype: auto` (the CPU configs) picks bf16 only on the first
kind; this bench shows what that choice is worth on the machine it runs on.

Each round runs one A/B pair, the order alternating from round to round; every run is a fresh
process pinned to one CPU set with one thread budget (bench.common.run_worker) that builds the
CPU default's colocate controller (bench/overhead.py's engine side) on the policy its config
prepares here (both sides the same weights), takes `--warmup` untimed steps and times `--steps`
steps. The sides' numerics differ, so their samples part after the first update; the per-step
work is the same on average (32 prompts x 8 samples of up to 4 tokens).

    python bench/matmul_dtype.py [--rounds 3] [--steps 20] [--warmup 3] [--cpus 0,1]
        [--threads 2]

Last line: `headline: bf16_over_f32_step = X`, the median over pairs of s/step in bf16 over
s/step in float32 (under 1: bf16 pays on this CPU).
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

SIDES = {"bfloat16": "bfloat16", "float32": ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    parser.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    add_pin_args(parser)
    args = parser.parse_args()
    if args.worker:
        model = {"matmul_dtype": SIDES[args.worker]}
        return overhead.worker("engine", args.steps, args.warmup, model=model)
    from relax_core.models.precision import MATMUL_AUTO, cpu_lacks_native_bf16, resolve_matmul_dtype

    native = "no" if cpu_lacks_native_bf16() else "yes (or cannot tell)"
    auto = resolve_matmul_dtype(MATMUL_AUTO) or "float32"
    print(f"native bf16 on this CPU: {native}; 'auto' computes in {auto} here", flush=True)
    overhead.step_ab(__file__, tuple(SIDES), args, "matmul_dtype", "bf16_over_f32_step")


if __name__ == "__main__":
    main()
