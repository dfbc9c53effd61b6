"""Every policy loss of the suite on the CPU default: held-out accuracy gain and wall time.

Each row is the CPU default (`configs/cpu-default.yaml`: tiny Qwen3 warm-started to ~0.21 on
2-digit addition, 200 colocate RL steps) with one algorithm swapped in, run in this process one
after another, same seed, same starting policy (prepared once, then cached). The distillation
rows use the GRPO row's final policy as the teacher for a student starting from the same
warm start: with rewards (GRPO + distillation term) and with the teacher as the only signal.

    python bench/algorithms.py [--steps 200] [--only grpo,sapo]
    python bench/algorithms.py --mode async --staleness 4     # the off-policy corrections

Last line: `headline: min_gain = X` (the smallest held-out accuracy gain, in points).
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
import tempfile
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", default="", help="comma-separated variant names")
    parser.add_argument("--cfg", default="", help="default: cpu-default (cpu-async with async)")
    parser.add_argument("--mode", choices=("colocate", "async"), default="colocate")
    parser.add_argument("--staleness", type=int, default=4, help="max_staleness with --mode async")
    args = parser.parse_args()
    os.chdir(REPO)  # dataset paths in the config are relative to the repo
    default = "cpu-async.yaml" if args.mode == "async" else "cpu-default.yaml"
    base = load_config(args.cfg or os.path.join(REPO, "configs", default))
    if args.mode == "async":
        base = replace(base, rollout={"max_staleness": args.staleness})
    else:
        base = replace(base, train={"torch_threads": 2})
    variants = ASYNC_VARIANTS if args.mode == "async" else VARIANTS
    names = [n for n in variants if not args.only or n in args.only.split(",")]
    root = tempfile.mkdtemp(prefix="bench-algorithms-")
    rows, teacher = [], ""
    for name in names:
        if "TEACHER" in str(variants[name]) and not teacher:
            _, _, teacher = run_variant(base, "teacher", {}, root, args.steps, "")
        summary, wall, final = run_variant(base, name, variants[name], root, args.steps, teacher)
        if name == "grpo":
            teacher = final
        before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
        rows.append((name, before, after, wall))
        print(f"{name}: {before:.3f} -> {after:.3f} in {wall:.0f} s", file=sys.stderr, flush=True)
    where = f"async, max_staleness {args.staleness}" if args.mode == "async" else "colocate"
    print(f"\n{args.steps} RL steps each ({where}); held-out greedy accuracy (256 pairs)")
    print("| algorithm | before | after | gain (points) | wall s |")
    print("| --- | --- | --- | --- | --- |")
    for name, before, after, wall in rows:
        print(
            f"| {name} | {before:.3f} | {after:.3f} | {100 * (after - before):+.1f} | {wall:.0f} |"
        )
    gains = [100 * (after - before) for _, before, after, _ in rows]
    print(f"headline: min_gain = {min(gains):.1f}")


if __name__ == "__main__":
    main()
