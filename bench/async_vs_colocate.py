"""Async vs colocate on this machine: time to a held-out accuracy, wall time of the same steps,
and the machine bound.

Each round is one seed (`--seeds`, one per round) and runs both sides, the order alternating
from round to round; every side is a fresh process pinned to one CPU set (`--cpus`) that every
process it starts inherits (bench.common.run_worker):
  colocate  `configs/cpu-default.yaml` (the model, numerics and warm start cpu-async.yaml has:
            both sides start from one policy), every role in one process with `--threads` torch
            threads;
  async     `configs/cpu-async.yaml` (and a variant's overrides), every role its own process,
            sharing the same CPUs as the config's services section says (the trainer takes the
            cores the rollout leaves).
Both start from the same cached warm-started policy of the round's seed, prepared here before
any worker runs. The untimed parts (start: eval at step 0 and checkpoint v0; finish: the final
held-out eval) run in the worker; the timed part is the training itself, around one child
process (colocate) or the supervisor and its role processes (async), imports and model loading
included for both.

Per round: the accuracy both sides reach (the lower of their final held-out accuracies) and
the time each first reaches it at an eval (`train.eval_every` sets the grid), so a side that
learns less per step is not credited for stepping faster; the wall time of the same number of
steps (overlap and per-step speed, not learning); and the machine bound, the CPU-seconds the
OS accounted to every async role process (wait4: user + system) over the cores: async can be no
faster than every core busy all the time.

    python bench/async_vs_colocate.py [--rounds 3] [--seeds 0,1,2] [--steps 200]
        [--variants elastic] [--cpus 0,1] [--threads 2]

Last lines, each the median over rounds (its per-round values and min-max on the line before):
`headline: async_speedup = X` (colocate's time to the accuracy both reach over the first async
variant's), `headline: async_same_steps_speedup = Y` (colocate's wall over async's for the same
steps) and `headline: machine_bound_ratio = Z` (async wall over its machine bound).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import json
import resource
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import (
    add_pin_args,
    cpu_set,
    placement,
    prepared_policy,
    print_headline,
    repo_data,
    run_worker,
    work_sections,
    write_config,
)

COLOCATE_CFG = os.path.join(REPO, "configs", "cpu-default.yaml")
ASYNC_CFG = os.path.join(REPO, "configs", "cpu-async.yaml")
VARIANTS: dict[str, dict] = {
    "elastic": {},
    "one-thread": {"services": {"trainer_threads": 1}},
    "s2": {"rollout": {"max_staleness": 2}},
    "s4": {"rollout": {"max_staleness": 4}},
    "mb2048": {"train": {"micro_batch_tokens": 2048}},
    "mb16k": {"train": {"micro_batch_tokens": 16384}},
}
"""Async variants: elastic (cpu-async.yaml as it is), one-thread (the trainer on 1 thread), s2
and s4 (max_staleness 2 / 4), mb2048 and mb16k (the trainer's micro-batch tokens)."""


def side_config(side: str, work: str, steps: int, seed: int):
    """The run config of one side ("colocate" or an async variant) for a seed."""
    from relax_core.config import load_config

    if side == "colocate":
        if load_config(COLOCATE_CFG).model != load_config(ASYNC_CFG).model:
            raise SystemExit(
                "cpu-default.yaml and cpu-async.yaml name different models: the sides would "
                "start from different policies"
            )
        return _config(COLOCATE_CFG, work, steps, seed)
    return _config(ASYNC_CFG, work, steps, seed, **VARIANTS[side])


def _config(path: str, work: str, steps: int, seed: int, **over):
    from relax_core.config import load_config, replace

    cfg = load_config(path)
    return replace(
        cfg,
        seed=seed,
        train={"total_steps": steps, **over.pop("train", {})},
        **work_sections(work, experiment="bench-async"),
        **repo_data(cfg),
        **over,
    )


def _start(cfg) -> str:
    from relax_core.run.lifecycle import start_run

    return start_run(cfg, prepared_policy(cfg))


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_colocate(cfg, work: str) -> dict:
    checkpoint = _start(cfg)
    cfg_path = write_config(cfg, os.path.join(work, "colocate.json"))
    code = (
        "import sys; from relax_core.roles.service import load_run_config; "
        "from relax_core.run.lifecycle import run_steps; "
        "cfg = load_run_config(sys.argv[1]); "
        "print(run_steps(cfg, sys.argv[2], cfg.train.total_steps))"
    )
    cpu0, t0, wall0 = _children_cpu(), time.perf_counter(), time.time()
    out = subprocess.run(
        [sys.executable, "-c", code, cfg_path, checkpoint], capture_output=True, text=True
    )
    wall, cpu = time.perf_counter() - t0, _children_cpu() - cpu0
    if out.returncode:
        raise SystemExit(f"colocate run failed:\n{out.stderr[-4000:]}")
    return _finish(cfg, out.stdout.strip().splitlines()[-1], wall, cpu, None, wall0)


def run_async(cfg, work: str) -> dict:
    from relax_core.ops.supervisor import run_async_local

    checkpoint = _start(cfg)
    t0, wall0 = time.perf_counter(), time.time()
    final = run_async_local(cfg, checkpoint)
    wall = time.perf_counter() - t0
    with open(os.path.join(os.path.dirname(final), "roles.json")) as f:
        roles = json.load(f)
    return _finish(cfg, final, wall, sum(r["cpu_s"] for r in roles), roles, wall0)


def _finish(cfg, checkpoint: str, wall: float, cpu: float, roles, wall0: float) -> dict:
    import mlflow

    from relax_core.run.lifecycle import finish_run
    from relax_core.train.checkpoint import read_state

    summary = finish_run(cfg, checkpoint)
    client = mlflow.tracking.MlflowClient(cfg.tracking.tracking_uri)
    run_id = read_state(checkpoint)["tracking_run_id"]

    def history(key: str) -> list[float]:
        return [
            m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
        ]

    keys = (
        "perf/step_s", "perf/train_s", "perf/sync_s", "perf/trainer_wait_s", "perf/rollout_s",
        "perf/generate_s", "perf/reward_s", "perf/rollout_wait_s", "perf/queue_s",
    )  # fmt: skip
    steps = {k: history(k) for k in keys}
    evals = [
        (m.step, m.value, m.timestamp)
        for m in sorted(client.get_metric_history(run_id, "eval/accuracy"), key=lambda m: m.step)
    ]
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "accuracy": summary["eval_accuracy_after"],
        "evals": [(s, v) for s, v, _ in evals],
        # (step, accuracy, seconds since the timed phase began) of every eval after step 0
        "eval_times": [(s, v, t / 1000 - wall0) for s, v, t in evals if s > 0],
        "per_step": {k: statistics.median(v[5:]) for k, v in steps.items() if len(v) > 5},
        "roles": roles,
    }


def worker(side: str, work: str, steps: int, seed: int) -> None:
    """One side of a round, in this (pinned) process; prints its result as JSON."""
    cfg = side_config(side, work, steps, seed)
    result = run_colocate(cfg, work) if side == "colocate" else run_async(cfg, work)
    print(json.dumps({**result, **placement()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", default="0,1,2", help="one per round, reused in turn")
    parser.add_argument("--keep", help="keep run directories under this path (default: temp)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--variants",
        default="elastic",
        help=f"comma-separated async variants: {', '.join(VARIANTS)}",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    add_pin_args(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.work, args.steps, args.seed)
    cpus = cpu_set(args.cpus)
    cores = len(cpus)
    chosen = args.variants.split(",")
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    seeds = [int(x) for x in args.seeds.split(",")]
    sides = ["colocate", *chosen]
    results: dict[str, list[dict]] = {side: [] for side in sides}
    round_seeds = []
    for r in range(args.rounds):
        seed = seeds[r % len(seeds)]
        round_seeds.append(seed)
        with tempfile.TemporaryDirectory(prefix="bench-async-", dir=args.keep) as work:
            for side in sides:  # the warm start once per seed, here, so no worker times it
                prepared_policy(side_config(side, work, args.steps, seed))
            for side in sides if r % 2 == 0 else sides[::-1]:
                side_work = os.path.join(work, side)
                os.makedirs(side_work)
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", side]
                cmd += ["--work", side_work, "--steps", str(args.steps), "--seed", str(seed)]
                results[side].append(run_worker(cmd, cpus, args.threads))
                _report(side, r, seed, results[side][-1], cores)
    best = chosen[0]
    print(
        f"\nCPUs {cpus}, colocate on {args.threads} threads; {args.steps} steps; "
        f"{args.rounds} rounds, seeds {round_seeds}"
    )
    print("| round | seed | side | wall s | cpu s | final held-out | both reach | time to it s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    speedup: dict[str, list[float]] = {v: [] for v in chosen}
    same_steps: dict[str, list[float]] = {v: [] for v in chosen}
    bound: dict[str, list[float]] = {v: [] for v in chosen}
    for r, seed in enumerate(round_seeds):
        col = results["colocate"][r]
        for name in chosen:
            run = results[name][r]
            # The accuracy both sides reach: the lower of the two final evals.
            target = min(col["accuracy"], run["accuracy"])
            t_col, t_run = _time_to(col, target), _time_to(run, target)
            speedup[name].append(t_col / t_run)
            same_steps[name].append(col["wall_s"] / run["wall_s"])
            bound[name].append(run["wall_s"] / (run["cpu_s"] / cores))
            for side, x, t in (("colocate", col, t_col), (name, run, t_run)):
                print(
                    f"| {r} | {seed} | {side} | {x['wall_s']:.1f} | {x['cpu_s']:.1f} | "
                    f"{x['accuracy']:.3f} | {target:.3f} | {t:.1f} |"
                )
    for name in chosen:
        print(
            f"{name}: time to the accuracy both reach, colocate / async per round "
            f"{', '.join(f'{x:.2f}' for x in speedup[name])}; same steps "
            f"{', '.join(f'{x:.2f}' for x in same_steps[name])}; wall / machine bound "
            f"{', '.join(f'{x:.2f}' for x in bound[name])}"
        )
    _projection(results[best][-1], results["colocate"][-1])
    print_headline("async_speedup", speedup[best])
    print_headline("async_same_steps_speedup", same_steps[best])
    print_headline("machine_bound_ratio", bound[best])


def _time_to(run: dict, target: float) -> float:
    """Seconds into the timed phase of the first eval at or above `target` (the whole phase
    when none reaches it)."""
    for _, value, seconds in run["eval_times"]:
        if value >= target - 1e-9:
            return seconds
    return run["wall_s"]


def _report(name: str, round_: int, seed: int, res: dict, cores: int) -> None:
    per = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in res["per_step"].items())
    print(
        f"[{name} round {round_}, seed {seed}] wall {res['wall_s']:.1f} s, cpu {res['cpu_s']:.1f} s "
        f"(bound {res['cpu_s'] / cores:.1f} s), accuracy {res['accuracy']:.3f}; per step "
        f"(median): {per}",
        flush=True,
    )
    print(f"    eval curve: {res['evals']}", flush=True)
    for role in res["roles"] or []:
        print(
            f"    {role['role']}-{role['worker']}: cpu {role['cpu_s']:.1f} s over "
            f"{role['wall_s']:.1f} s wall ({role['cpu_s'] / role['wall_s']:.0%} of one core)"
        )


def _projection(async_run: dict, colocate_run: dict) -> None:
    """Step time with one device per role, from the busy time each role measured here (one
    thread each): the slowest role sets the pace."""
    p = async_run["per_step"]
    trainer = p.get("perf/train_s", 0.0) + p.get("perf/sync_s", 0.0)
    rollout = p.get("perf/generate_s", 0.0) + p.get("perf/reward_s", 0.0)
    if not trainer or not rollout:  # per-step medians leave out the first 5 steps
        print("projection: too few steps for per-step role times")
        return
    c = colocate_run["per_step"]
    print(
        f"projection, one device per role: trainer busy {trainer:.3f} s/step, rollout busy "
        f"{rollout:.3f} s/step -> async {max(trainer, rollout):.3f} s/step vs the same roles "
        f"in sequence {trainer + rollout:.3f} s/step ({(trainer + rollout) / max(trainer, rollout):.2f}x); "
        f"colocate here: {c.get('perf/step_s', 0.0):.3f} s/step"
    )


if __name__ == "__main__":
    main()
