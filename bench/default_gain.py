"""The CPU default's RL gain over seeds: held-out accuracy before and after RL, seed by seed.

For each seed, configs/cpu-default.yaml runs whole as the README's main job runs it, through
`python -m relax_core.entrypoints.run --cfg` (bench.common.LAUNCHER: preflight, the prepared
policy, the colocate steps, the final eval; the code path `pyflyte run` takes node by node).
The config is the file as it is but for the seed, where the run writes (a work directory per
seed), the shared policy cache and no model registration. The seed draws the tiny policy's
weights and its warm start's batches (PolicySpec keys the cache on it), so every seed has a
warm start of its own, prepared once inside its first run and reused afterwards.

Each run is a fresh process pinned with os.sched_setaffinity to one CPU set before it starts
(bench.common.run_pinned), with one torch thread count (train.torch_threads and OMP/MKL).

    python bench/default_gain.py [--seeds 0-9] [--cpus 0,1] [--threads 2] [--steps N]

Prints per seed the warm start's steps (it ends at warm_start.target_accuracy), the step-0 and
final held-out accuracy, the gain in points, the RL steps, the run's wall seconds and the prepared
policy; then the gain's median and min-max, the seeds at +30 or more, and last
`headline: default_gain_p10 = X`: the 10th percentile over the seeds of the gain in held-out
points (statistics.quantiles, inclusive). The goal is +30 or more in 9 seeds of 10.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import glob
import json
import statistics
import tempfile
import time

from bench.common import (
    LAUNCHER,
    POLICY_CACHE,
    add_pin_args,
    cpu_set,
    median_range,
    repo_data,
    run_pinned,
    work_sections,
    write_config,
)

GOAL = 30.0
"""Points of held-out accuracy RL should add for (nearly) every seed."""


def seed_list(spec: str) -> list[int]:
    """ "0-9" or "0,3,5" (or both, comma-separated) as a list of seeds."""
    seeds: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        seeds.extend(range(int(first), int(last or first) + 1))
    return seeds


def run_seed(seed: int, work: str, cpus: list[int], threads: int, steps: int) -> dict:
    """One whole run of the CPU default with `seed`; its summary.json (eval before and after)."""
    from relax_core.config import load_config, replace
    from relax_core.data.dataset import fingerprint
    from relax_core.run.prepare import PolicySpec

    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    sections = work_sections(work, registered_model="")
    cfg = replace(cfg, seed=seed, **sections, **repo_data(cfg))
    train = {"torch_threads": threads, **({"total_steps": steps} if steps else {})}
    cfg = replace(cfg, train=train)
    path = write_config(cfg, os.path.join(work, "cfg.json"))
    t0 = time.perf_counter()
    out = run_pinned([sys.executable, "-m", LAUNCHER, "--cfg", path], cpus, threads, timeout=3600)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"seed {seed}: the run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    (found,) = glob.glob(os.path.join(work, "checkpoints", "*", "summary.json"))
    with open(found) as f:
        summary = json.load(f)
    key = PolicySpec.of(cfg, fingerprint(cfg.data.train_path)).key()
    with open(os.path.join(POLICY_CACHE, key, "PREPARED.json")) as f:
        prepared = json.load(f)
    return {
        "seed": seed,
        "warm_steps": prepared.get("warm_start_steps", cfg.warm_start.steps),
        "before": summary["eval_accuracy_before"],
        "after": summary["eval_accuracy_after"],
        "steps": summary["steps"],
        "wall_s": wall,
        "policy": key,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-9", help='seeds, e.g. "0-9" or "0,4,7"')
    parser.add_argument("--steps", type=int, default=0, help="RL steps (0 = the config's)")
    add_pin_args(parser)
    args = parser.parse_args()
    cpus, seeds = cpu_set(args.cpus), seed_list(args.seeds)
    print(
        f"configs/cpu-default.yaml, seeds {seeds}, CPUs {cpus}, {args.threads} torch threads, "
        f"policy cache {POLICY_CACHE}",
        flush=True,
    )
    print(
        f"{'seed':>4} {'warm':>5} {'step 0':>7} {'final':>7} {'gain':>6} {'steps':>5} {'wall s':>7}"
        "  policy"
    )
    rows = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix=f"default-gain-{seed}-") as work:
            row = run_seed(seed, work, cpus, args.threads, args.steps)
        row["gain"] = 100.0 * (row["after"] - row["before"])
        rows.append(row)
        print(
            f"{seed:>4} {row['warm_steps']:>5} {row['before']:>7.3f} {row['after']:>7.3f} {row['gain']:>+6.1f} "
            f"{row['steps']:>5} {row['wall_s']:>7.0f}  {row['policy']}",
            flush=True,
        )
    gains = [r["gain"] for r in rows]
    reached = sum(g >= GOAL for g in gains)
    print(f"gain (points): median (min-max) {median_range(gains, 1)}")
    print(f"seeds at +{GOAL:.0f} or more: {reached} of {len(gains)}")
    p10 = statistics.quantiles(gains, n=10, method="inclusive")[0] if len(gains) > 1 else gains[0]
    print(f"headline: default_gain_p10 = {p10:.1f}")


if __name__ == "__main__":
    main()
