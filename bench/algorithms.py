"""Every policy loss of the suite on the CPU default: held-out accuracy gain and wall time.

Each row is the CPU default (`configs/cpu-default.yaml`: tiny Qwen3 warm-started until it is
right a fifth of the time on 2- and on 3-digit sums, then `--steps` colocate RL steps on 2-digit
addition) with one algorithm swapped in, on each seed of `--seeds`: a whole run per seed, each in
a fresh process pinned to one CPU set with one thread budget (bench.common.run_worker), one after
another, every algorithm of a seed from the same starting policy (the seed's warm start,
prepared here once before its runs, then cached). The distillation rows use the seed's GRPO run's
final policy as the teacher for a student starting from the same warm start: with rewards (GRPO
+ distillation term) and with the teacher as the only signal.

    python bench/algorithms.py [--steps 200] [--seeds 0,1,2] [--only grpo,sapo] [--cpus 0,1]
        [--threads 2]
    python bench/algorithms.py --mode async --staleness 4     # the off-policy corrections

Last line: `headline: min_gain = X`: per algorithm the median held-out accuracy gain over the
seeds, in points; X is the smallest of those medians (that algorithm's range on the line before).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue` (imported by torch, s3fs and concurrent.futures): put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import argparse
import dataclasses
import json
import shutil
import statistics
import tempfile
import time

from bench.common import (
    add_pin_args,
    cpu_set,
    median_range,
    placement,
    prepared_policy,
    run_worker,
)
from relax_core.config import load_config, replace

# name -> section overrides; "teacher" is filled in from the grpo row's final checkpoint.
VARIANTS: dict[str, dict] = {
    "grpo": {},
    "gspo": {
        "algorithm": {
            "loss": "gspo",
            "eps_clip": 3e-4,
            "eps_clip_high": 4e-4,
            "loss_agg": "seq_mean_token_mean",
        }
    },
    "sapo": {"algorithm": {"loss": "sapo"}},
    "decoupled_ppo": {"algorithm": {"loss": "decoupled_ppo"}, "train": {"minibatches_per_step": 2}},
    "grpo+tis+dual_clip": {"algorithm": {"is_mode": "tis", "dual_clip": 3.0}},
    "dapo": {
        "algorithm": {"loss_agg": "dr_grpo", "eps_clip_high": 0.28},
        "rollout": {"dynamic_sampling": True},
    },
    # MiniMax-M1 leaves the IS weight without a lower bound (a large eps_low): 1 - 1.0 = 0.
    "cispo": {"algorithm": {"loss": "cispo", "eps_clip": 1.0}},
    "gmpo": {
        "algorithm": {
            "loss": "gmpo",
            "eps_clip": 0.33,
            "eps_clip_high": 0.49,
            "loss_agg": "seq_mean_token_mean",
        }
    },
    "grpo+icepop": {"algorithm": {"is_mode": "icepop"}},
    "grpo+opsm": {"algorithm": {"seq_mask": "kl"}},
    "grpo+geometric_mis": {"algorithm": {"is_mode": "mis", "is_level": "geometric"}},
    "rloo": {"algorithm": {"advantage": "rloo", "normalize_adv_std": False}},
    "reinforce_pp": {"algorithm": {"advantage": "reinforce_pp", "advantage_level": "token"}},
    "reinforce_pp_baseline": {"algorithm": {"advantage": "reinforce_pp_baseline"}},
    "grpo+distill": {"algorithm": {"distill_coef": 0.5, "teacher": "TEACHER"}},
    "distill only": {"algorithm": {"advantage": "none", "distill_coef": 1.0, "teacher": "TEACHER"}},
}


# `--mode async`: configs/cpu-async.yaml at `--staleness` with each off-policy correction. The
# proximal policy is interpolated by version (the ratio of a stale row starts at 1), so what
# bounds a stale update is the correction; "behaviour" (the shipped cpu-async setting) clips
# against the policy that generated the rows instead, and "none" corrects nothing.
ASYNC_VARIANTS: dict[str, dict] = {
    "grpo (behaviour clip)": {"algorithm": {"proximal": "behaviour"}},
    "grpo (no correction)": {"algorithm": {"proximal": "interpolate"}},
    "grpo+tis": {"algorithm": {"proximal": "interpolate", "is_mode": "tis"}},
    "grpo+icepop": {"algorithm": {"proximal": "interpolate", "is_mode": "icepop"}},
    "grpo+geometric_mis": {
        "algorithm": {"proximal": "interpolate", "is_mode": "mis", "is_level": "geometric"}
    },
    "grpo+opsm": {"algorithm": {"proximal": "interpolate", "seq_mask": "kl"}},
    "cispo (behaviour)": {"algorithm": {"loss": "cispo", "proximal": "behaviour", "eps_clip": 1.0}},
    "cispo, lower bound 0.8 (behaviour)": {"algorithm": {"loss": "cispo", "proximal": "behaviour"}},
    "gmpo (behaviour)": {
        "algorithm": {
            "loss": "gmpo",
            "proximal": "behaviour",
            "eps_clip": 0.33,
            "eps_clip_high": 0.49,
            "loss_agg": "seq_mean_token_mean",
        }
    },
}


def base_config(mode: str, cfg_path: str, staleness: int, seed: int):
    """The config every row of a seed starts from."""
    default = "cpu-async.yaml" if mode == "async" else "cpu-default.yaml"
    base = replace(load_config(cfg_path or os.path.join(REPO, "configs", default)), seed=seed)
    if mode == "async":
        return replace(base, rollout={"max_staleness": staleness})
    return base


def run_variant(base, name: str, overrides: dict, root: str, steps: int, teacher: str):
    from relax_core.run.lifecycle import run

    sections = {k: dict(v) for k, v in overrides.items()}
    if sections.get("algorithm", {}).get("teacher") == "TEACHER":
        sections["algorithm"]["teacher"] = teacher
    slug = name.replace("+", "-").replace(" ", "-")
    sections.setdefault("train", {}).update(total_steps=steps, steps_per_node=steps)
    sections["tracking"] = {
        "experiment": "bench-algorithms",
        "progress": False,
        "tracking_uri": f"sqlite:///{root}/mlflow.db",
    }
    sections["checkpoint"] = {
        "dir": f"{root}/checkpoints",
        "policy_cache_dir": base.checkpoint.policy_cache_dir,
    }
    sections["queue"] = {"root": f"{root}/queue"}
    cfg = replace(base, **sections)
    cfg = dataclasses.replace(cfg, run_name=f"bench-{slug}")
    t0 = time.perf_counter()
    summary = run(cfg)
    wall = time.perf_counter() - t0
    final = os.path.join(cfg.checkpoint.dir, summary["run_id"])
    last = sorted(d for d in os.listdir(final) if d.startswith("step_"))[-1]
    return summary, wall, os.path.join(final, last)


def worker(args: argparse.Namespace) -> None:
    """One row of one seed, in this (pinned) process; prints its result as JSON."""
    os.chdir(REPO)  # dataset paths in the config are relative to the repo
    base = base_config(args.mode, args.cfg, args.staleness, args.seed)
    variants = ASYNC_VARIANTS if args.mode == "async" else VARIANTS
    overrides = {} if args.worker == "teacher" else variants[args.worker]
    summary, wall, final = run_variant(
        base, args.worker, overrides, args.root, args.steps, args.teacher
    )
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    print(
        json.dumps({"before": before, "after": after, "wall": wall, "final": final, **placement()})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--seeds", default="0,1,2", help="comma-separated seeds, each a whole suite"
    )
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--cfg", default="", help="default: cpu-default (cpu-async with async)")
    parser.add_argument("--mode", choices=("colocate", "async"), default="colocate")
    parser.add_argument("--staleness", type=int, default=4, help="max_staleness with --mode async")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--teacher", default="", help=argparse.SUPPRESS)
    add_pin_args(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    os.chdir(REPO)
    cpus = cpu_set(args.cpus)
    variants = ASYNC_VARIANTS if args.mode == "async" else VARIANTS
    names = [n for n in variants if not args.only or n in args.only.split(",")]
    unknown = set(args.only.split(",")) - set(variants) if args.only else set()
    if unknown:
        raise SystemExit(f"--only: unknown {sorted(unknown)}; choose from {', '.join(variants)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    results: dict[str, list[dict]] = {name: [] for name in names}

    def row(name: str, seed: int, root: str, teacher: str) -> dict:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--seed", str(seed)]
        cmd += ["--root", root, "--teacher", teacher, "--steps", str(args.steps)]
        cmd += ["--mode", args.mode, "--staleness", str(args.staleness)]
        cmd += ["--cfg", args.cfg] if args.cfg else []
        return run_worker(cmd, cpus, args.threads)

    for seed in seeds:
        root = tempfile.mkdtemp(prefix="bench-algorithms-")
        base = base_config(args.mode, args.cfg, args.staleness, seed)
        prepared_policy(base)  # the seed's warm start once, here, so no row times it
        teacher = ""
        for name in names:
            if "TEACHER" in str(variants[name]) and not teacher:
                teacher = row("teacher", seed, root, "")["final"]
            res = row(name, seed, root, teacher)
            if name == "grpo":
                teacher = res["final"]
            results[name].append(res)
            print(
                f"seed {seed} {name}: {res['before']:.3f} -> {res['after']:.3f} in "
                f"{res['wall']:.0f} s",
                file=sys.stderr,
                flush=True,
            )
        shutil.rmtree(root, ignore_errors=True)
    where = f"async, max_staleness {args.staleness}" if args.mode == "async" else "colocate"
    print(
        f"\n{args.steps} RL steps each ({where}), seeds {seeds}, CPUs {cpus}, {args.threads} "
        "threads; held-out greedy accuracy (256 pairs)"
    )
    print(
        "| algorithm | before per seed | after per seed | gain (points) per seed | median gain (min-max) | wall s (median) |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    medians = {}
    for name in names:
        runs = results[name]
        gains = [100 * (x["after"] - x["before"]) for x in runs]
        medians[name] = (statistics.median(gains), gains)
        print(
            f"| {name} | {' '.join(format(x['before'], '.3f') for x in runs)} | "
            f"{' '.join(format(x['after'], '.3f') for x in runs)} | "
            f"{' '.join(f'{g:+.1f}' for g in gains)} | {median_range(gains, 1)} | "
            f"{statistics.median(x['wall'] for x in runs):.0f} |"
        )
    lowest = min(medians, key=lambda n: medians[n][0])
    print(f"lowest median gain: {lowest}, per seed {median_range(medians[lowest][1], 1)}")
    print(f"headline: min_gain = {medians[lowest][0]:.1f}")


if __name__ == "__main__":
    main()
