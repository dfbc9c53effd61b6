"""The main job before and after a change: the whole `pyflyte run` of the CPU default, A B A B.

Checks out `--before` (a git revision) into a temporary worktree and runs
`pyflyte run workflows/train.py train --cfg C` from that tree (A) and from this one (B), the
order alternating from round to round (A B, B A, ...), each in a fresh empty work directory (the
warm start included: a user's first run pays for it), every process of both sides pinned to the
same CPU set with the same torch thread budget (bench/common.py `pinned_env`). The config is the
same file for both sides with its state directories pointed into the work directory, so neither
side finds a cache the other filled.

    python bench/main_job.py --before <rev> [--rounds 3] [--cfg configs/cpu-default.yaml]
        [--cpus 0,1] [--threads 2]

Last line: `headline: main_job_after_over_before = X` (B/A per round, the median over rounds,
with the values and range on the line before; 1.0 = as fast).
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
import subprocess
import tempfile
import time

import yaml

from bench.common import cpu_set, pinned_env, print_headline


def _config(src: str, work: str) -> str:
    """`src` with every place a run writes inside `work` (fields both sides know)."""
    with open(src) as f:
        data = yaml.safe_load(f)
    data.setdefault("queue", {})["root"] = os.path.join(work, "state", "queue")
    data.setdefault("checkpoint", {})["dir"] = os.path.join(work, "state", "checkpoints")
    data["checkpoint"]["policy_cache_dir"] = os.path.join(work, "state", "policies")
    data.setdefault("tracking", {})["tracking_uri"] = f"sqlite:///{work}/mlflow.db"
    path = os.path.join(work, "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def _timed(tree: str, cfg: str, cpus: list[int], threads: int) -> tuple[float, str]:
    work = tempfile.mkdtemp(prefix="main-job-")
    os.makedirs(os.path.join(work, "tmp"))
    path = _config(os.path.join(tree, cfg), work)
    # The thread budget of every pinned bench process, with this side's own tree first on
    # PYTHONPATH (ahead of the installed relax_core) and a temporary directory of its own.
    env = {**pinned_env(threads), "PYTHONPATH": tree, "TMPDIR": os.path.join(work, "tmp")}
    cmd = ["pyflyte", "run", "workflows/train.py", "train", "--cfg", path]
    t0 = time.perf_counter()
    out = subprocess.run(
        cmd,
        cwd=tree,
        env=env,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),  # every process it starts inherits it
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: pyflyte run failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    accuracy = next(
        (
            ln.split("eval accuracy", 1)[1].strip()
            for ln in out.stderr.splitlines()
            if "eval accuracy" in ln
        ),
        "?",
    )
    return wall, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="git revision to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cfg", default="configs/cpu-default.yaml")
    parser.add_argument("--cpus", default="0,1", help="CPU set every process of both sides runs on")
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process")
    args = parser.parse_args()
    cpus = cpu_set(args.cpus)
    before = tempfile.mkdtemp(prefix="main-job-before-")
    subprocess.run(
        ["git", "worktree", "add", "--detach", before, args.before], cwd=REPO, check=True
    )
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    rows = []
    try:
        for r in range(args.rounds):
            if r % 2 == 0:
                a, acc_a = _timed(before, args.cfg, cpus, args.threads)
                b, acc_b = _timed(REPO, args.cfg, cpus, args.threads)
            else:
                b, acc_b = _timed(REPO, args.cfg, cpus, args.threads)
                a, acc_a = _timed(before, args.cfg, cpus, args.threads)
            rows.append((a, b))
            print(f"round {r + 1}: before {a:.1f} s (acc {acc_a}), after {b:.1f} s (acc {acc_b})")
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", before], cwd=REPO)
    ratios = [b / a for a, b in rows]
    befores, afters = [a for a, _ in rows], [b for _, b in rows]
    print("\n| side | revision | median (s) | min-max (s) |\n|---|---|---|---|")
    print(
        f"| before | {args.before} | {statistics.median(befores):.1f} | "
        f"{min(befores):.1f}-{max(befores):.1f} |"
    )
    print(
        f"| after | {head} | {statistics.median(afters):.1f} | "
        f"{min(afters):.1f}-{max(afters):.1f} |"
    )
    print_headline("main_job_after_over_before", ratios, 3)


if __name__ == "__main__":
    main()
