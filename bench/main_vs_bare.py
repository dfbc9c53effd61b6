"""The main job against a bare loop: wall time to +30 held-out points, warm starts included.

Per round (round r takes seed r of `--seeds`, cycling; the config's seed by default), A and B,
A first in even rounds and B first in odd ones (a drifting machine favours neither), every
process pinned to the same CPU set and thread budget (bench.common.run_pinned / run_worker):
  A. `pyflyte run workflows/train.py train --cfg C`: the config with that seed and every place a
     run writes (queue, checkpoints, MLflow store, policy cache) in a fresh work directory, so the
     warm start runs and counts (Flyte's local cache of prepare_policy is keyed on the cache
     directory, so it misses too). Its held-out evals come from the run's MLflow store:
     `eval/accuracy` per step, each timestamped when it was logged, right after the eval.
  B. `python bench/bare_grpo.py --cfg C --seed S`: the same settings in plain PyTorch, its own warm
     start, evals at the same steps (train.eval_every) on the same held-out rows; it stops at +30.
Each side's time to +30 runs from just before its process is spawned to the log time of its first
eval at >= its own step-0 accuracy + `--target`. A side that does not get there within
train.total_steps has no time, and the round no ratio. The two do the same math in the same
order (bench/bare_grpo.py), so on one thread count both print the same evals and the ratio is
time alone. Of the CPU default's seeds 0-6 only 0 (step 125) and 3 (step 175) reach +30 in
200 steps (at 2a93cae): the warm start of 1, 2, 5 and 6 ends at 1-7% held-out accuracy, where a
group rarely holds a right answer to learn from, and 4 gets +23.

Each round's MLflow store is a new file, which the run starts from the empty store shipped for
the pinned mlflow (relax_core/tracking/store.py); `--warm-mlflow` gives each run's work directory
a store MLflow made before the clock starts instead. flytekit's literal type of the run config
comes from the user's cache when an earlier run on this machine built it (tasks/flyte_types.py),
as it does for a user's second run; `--cold-caches` gives each of our runs an empty one
(RELAX_CACHE_DIR), as on a machine's first run (about 0.8 s more on 2 cores).

    python bench/main_vs_bare.py [--rounds 3] [--seeds 0] [--cpus 0,1] [--threads 2] [--cold-caches]

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


def migrated_store(path: str) -> None:
    """An empty MLflow sqlite store at `path`, its schema migrated."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()


def ours(cfg: str, work: str, cpus: list[int], threads: int, cold_caches: bool = False):
    """The main job: (spawn time, wall seconds, evals)."""
    pyflyte = os.path.join(os.path.dirname(sys.executable), "pyflyte")
    cmd = [pyflyte, "run", os.path.join(REPO, "workflows", "train.py"), "train", "--cfg", cfg]
    os.makedirs(os.path.join(work, "tmp"))
    env = {**os.environ, "TMPDIR": os.path.join(work, "tmp")}
    if cold_caches:
        env["RELAX_CACHE_DIR"] = os.path.join(work, "cache")
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", default="", help="round r's seed: r-th, cycling (config's)")
    parser.add_argument("--cfg", default=os.path.join(REPO, "configs", "cpu-default.yaml"))
    parser.add_argument("--target", type=float, default=0.30, help="held-out accuracy gain")
    parser.add_argument("--warm-mlflow", action="store_true", help="stores MLflow made beforehand")
    parser.add_argument("--cold-caches", action="store_true", help="an empty relax cache per run")
    add_pin_args(parser)
    args = parser.parse_args()
    with open(args.cfg) as f:
        default_seed = int(yaml.safe_load(f).get("seed", 0))
    seed_list = [int(s) for s in args.seeds.split(",")] if args.seeds else [default_seed]
    cpus, seeds = cpu_set(args.cpus), [seed_list[r % len(seed_list)] for r in range(args.rounds)]
    template = tempfile.mkdtemp(prefix="main-vs-bare-mlflow-")
    if args.warm_mlflow:
        migrated_store(os.path.join(template, "mlflow.db"))
    times: dict[str, list[float | None]] = {"ours": [], "bare": []}
    to_step0: dict[str, list[float]] = {"ours": [], "bare": []}
    for r, seed in enumerate(seeds):
        work = tempfile.mkdtemp(prefix="main-vs-bare-")
        try:
            if args.warm_mlflow:
                shutil.copy(os.path.join(template, "mlflow.db"), work)
            cfg = write_config(args.cfg, work, seed)
            # The order alternates, so a machine that drifts faster or slower over the run
            # favours neither side.
            runs = {}
            for side in ("ours", "bare") if r % 2 == 0 else ("bare", "ours"):
                if side == "ours":
                    runs[side] = ours(cfg, work, cpus, args.threads, args.cold_caches)
                else:
                    runs[side] = bare(cfg, seed, args.target, cpus, args.threads)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for side in ("ours", "bare"):
            start, wall, evals = runs[side]
            seconds, step = time_to_target(evals, start, args.target)
            times[side].append(seconds)
            to_step0[side].append(evals[0][2] - start)
            reached = "not reached" if seconds is None else f"{seconds:.1f} s (step {step})"
            print(f"seed {seed} {side}: +{args.target:.2f} in {reached}; step-0 eval at "
                  f"{evals[0][2] - start:.1f} s; process {wall:.1f} s; evals {fmt(evals)}",
                  flush=True)  # fmt: skip
    shutil.rmtree(template, ignore_errors=True)
    pairs = [(o, b) for o, b in zip(times["ours"], times["bare"], strict=True) if o and b]
    store = "made by MLflow beforehand" if args.warm_mlflow else "a new file (from the template)"
    cache = "empty per run" if args.cold_caches else "as earlier runs on this machine left it"
    print(f"\nseeds {seeds}; CPUs {cpus}; {args.threads} torch threads per process (OMP); "
          f"MLflow store {store}; relax cache {cache}")  # fmt: skip
    print("\n| side | time to +30 (s) | of it, to the step-0 eval (s) | rounds that got there |")
    print("| --- | --- | --- | --- |")
    for side, values in times.items():
        got = [v for v in values if v is not None]
        spread = median_range(got, 1) if got else "-"
        print(
            f"| {side} | {spread} | {median_range(to_step0[side], 1)} | {len(got)}/{len(values)} |"
        )
    print("(median (min-max) over rounds; the step-0 eval follows imports, warm start and setup)")
    if not pairs:
        raise SystemExit("no round where both sides reached the target: no headline")
    ratios = [o / b for o, b in pairs]
    print(f"ours / bare per round: {', '.join(f'{x:.2f}' for x in ratios)}")
    print(f"headline: main_vs_bare_time_to_30 = {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
