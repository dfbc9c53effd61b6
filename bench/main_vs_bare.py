"""The main job against a bare loop: wall time to +30 held-out points, warm starts included.

Per round, one seed, A then B, every process pinned to the same CPU set and thread budget
(bench.common.run_pinned / run_worker):
  A. `pyflyte run workflows/train.py train --cfg C`: the config with that seed and every place a
     run writes (queue, checkpoints, MLflow store, policy cache) in a fresh work directory, so the
     warm start runs and counts (Flyte's local cache of prepare_policy is keyed on the cache
     directory, so it misses too). Its held-out evals come from the run's MLflow store:
     `eval/accuracy` per step, each timestamped when it was logged, right after the eval.
  B. `python bench/bare_grpo.py --cfg C --seed S`: the same settings in plain PyTorch, its own warm
     start, evals at the same steps (train.eval_every) on the same held-out rows; it stops at +30.
Each side's time to +30 runs from just before its process is spawned to the log time of its first
eval at >= its own step-0 accuracy + `--target`. A side that does not get there within
train.total_steps has no time, and the round no ratio.

    python bench/main_vs_bare.py [--seeds 0,1,2] [--cpus 0,1] [--threads 2]

Last line: `headline: main_vs_bare_time_to_30 = X`, the median over rounds of ours / bare
(goal <= 1.3).
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
import time

import yaml

from bench.common import add_pin_args, cpu_set, median_range, run_pinned, run_worker

EVAL_KEY = "eval/accuracy"


def write_config(src: str, work: str, seed: int) -> str:
    """`src` with `seed` and every place a run writes under `work`; returns its path."""
    with open(src) as f:
        data = yaml.safe_load(f)
    data["seed"] = seed
    data.setdefault("queue", {})["root"] = os.path.join(work, "state", "queue")
    data.setdefault("checkpoint", {})["dir"] = os.path.join(work, "state", "checkpoints")
    data["checkpoint"]["policy_cache_dir"] = os.path.join(work, "state", "policies")
    data.setdefault("tracking", {})["tracking_uri"] = f"sqlite:///{work}/mlflow.db"
    path = os.path.join(work, "cfg.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def time_to_target(evals: list[tuple[int, float, float]], start: float, target: float):
    """(seconds from `start`, step) of the first eval at >= step 0 + `target`, or (None, None).
    `evals`: (step, accuracy, epoch seconds) in step order."""
    base = evals[0][1]
    for step, accuracy, logged in evals:
        if accuracy - base >= target - 1e-9:
            return logged - start, step
    return None, None


def mlflow_evals(work: str) -> list[tuple[int, float, float]]:
    """The held-out evals of the one run in `work`'s MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    if len(runs) != 1:
        raise SystemExit(f"{work}: expected one MLflow run, found {len(runs)}")
    history = client.get_metric_history(runs[0].info.run_id, EVAL_KEY)
    return sorted((m.step, m.value, m.timestamp / 1000) for m in history)


def ours(cfg: str, work: str, cpus: list[int], threads: int):
    """The main job: (spawn time, wall seconds, evals)."""
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    cmd = [pyflyte, "run", os.path.join(REPO, "workflows", "train.py"), "train", "--cfg", cfg]
    os.makedirs(os.path.join(work, "tmp"))
    env = {**os.environ, "TMPDIR": os.path.join(work, "tmp")}
    start = time.time()
    out = run_pinned(cmd, cpus, threads, env=env, timeout=3600)
    wall = time.time() - start
    if out.returncode:
        raise SystemExit(f"pyflyte run failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return start, wall, mlflow_evals(work)


def bare(cfg: str, seed: int, target: float, cpus: list[int], threads: int):
    """The bare loop: (spawn time, wall seconds, evals)."""
    cmd = [sys.executable, os.path.join(REPO, "bench", "bare_grpo.py"), "--cfg", cfg]
    cmd += ["--seed", str(seed), "--target", str(target)]
    start = time.time()
    result = run_worker(cmd, cpus, threads, timeout=3600)
    wall = time.time() - start
    return start, wall, [(e["step"], e["accuracy"], e["time"]) for e in result["evals"]]


def fmt(evals: list[tuple[int, float, float]]) -> str:
    return " ".join(f"{step}:{acc:.3f}" for step, acc, _ in evals)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="one round per seed")
    parser.add_argument("--cfg", default=os.path.join(REPO, "configs", "cpu-default.yaml"))
    parser.add_argument("--target", type=float, default=0.30, help="held-out accuracy gain")
    add_pin_args(parser)
    args = parser.parse_args()
    cpus, seeds = cpu_set(args.cpus), [int(s) for s in args.seeds.split(",")]
    times: dict[str, list[float | None]] = {"ours": [], "bare": []}
    for seed in seeds:
        work = tempfile.mkdtemp(prefix="main-vs-bare-")
        try:
            cfg = write_config(args.cfg, work, seed)
            runs = {
                "ours": ours(cfg, work, cpus, args.threads),
                "bare": bare(cfg, seed, args.target, cpus, args.threads),
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for side, (start, wall, evals) in runs.items():
            seconds, step = time_to_target(evals, start, args.target)
            times[side].append(seconds)
            reached = "not reached" if seconds is None else f"{seconds:.1f} s (step {step})"
            print(f"seed {seed} {side}: +{args.target:.2f} in {reached}; step-0 eval at "
                  f"{evals[0][2] - start:.1f} s; process {wall:.1f} s; evals {fmt(evals)}",
                  flush=True)  # fmt: skip
    pairs = [(o, b) for o, b in zip(times["ours"], times["bare"], strict=True) if o and b]
    print(f"\nseeds {seeds}; CPUs {cpus}; {args.threads} torch threads per process (OMP)")
    print(
        "\n| side | time to +30 (s), median (min-max) | rounds that got there |\n| --- | --- | --- |"
    )
    for side, values in times.items():
        got = [v for v in values if v is not None]
        spread = median_range(got, 1) if got else "-"
        print(f"| {side} | {spread} | {len(got)}/{len(values)} |")
    if not pairs:
        raise SystemExit("no round where both sides reached the target: no headline")
    ratios = [o / b for o, b in pairs]
    print(f"ours / bare per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"headline: main_vs_bare_time_to_30 = {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
