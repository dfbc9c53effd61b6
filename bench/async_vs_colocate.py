"""Async vs colocate on this machine: wall time of the same RL run, and the machine bound.

For each round, in one process on the same cores: colocate (`configs/cpu-default.yaml` with
`configs/cpu-async.yaml`'s model section, every role in one process, torch's default threads) and
async (`configs/cpu-async.yaml`, every role its own process). Both start from the same cached
warm-started policy; the untimed parts (start:
eval at step 0 and checkpoint v0; finish: the final held-out eval) run in this process. The
timed part is the training itself, measured around one child process (colocate) or the
supervisor and its role processes (async), imports and model loading included for both.

Machine bound: the CPU-seconds the OS accounted to every async role process (wait4: user +
system) divided by the cores. Async can be no faster than that: it is what the work would take
with every core busy all the time.

    python bench/async_vs_colocate.py [--rounds 1] [--steps 200]

Last lines: `headline: async_speedup = X` (time colocate takes to reach its own final held-out
accuracy / time async takes to reach it, median over rounds; the same-steps and per-step wall
ratios are printed above it) and `headline: machine_bound_ratio = Y` (async wall / machine
bound, for the same number of steps).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import prepared_policy, repo_data, work_sections, write_config


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _config(path: str, work: str, steps: int, **over):
    from relax_core.config import load_config, replace

    cfg = load_config(path)
    return replace(
        cfg,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--keep", help="keep run directories under this path (default: temp)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--colocate", default=os.path.join(REPO, "configs", "cpu-default.yaml"))
    parser.add_argument("--async-cfg", default=os.path.join(REPO, "configs", "cpu-async.yaml"))
    parser.add_argument(
        "--variants",
        default="elastic",
        help="comma-separated async variants: elastic (cpu-async.yaml), one-thread (trainer 1 "
        "thread), s2, s4 (max_staleness 2 / 4), mb2048, mb16k (trainer micro-batch tokens)",
    )
    args = parser.parse_args()
    cores = _cores()
    variants = {
        "elastic": {},
        "one-thread": {"services": {"trainer_threads": 1}},
        "s2": {"rollout": {"max_staleness": 2}},
        "s4": {"rollout": {"max_staleness": 4}},
        "mb2048": {"train": {"micro_batch_tokens": 2048}},
        "mb16k": {"train": {"micro_batch_tokens": 16384}},
    }
    chosen = args.variants.split(",")
    results: dict[str, list[dict]] = {"colocate": [], **{v: [] for v in chosen}}
    # The colocate side on the async config's model, so both start from one policy
    # (cpu-default computes its matmuls in bf16, which async roles do not take).
    from relax_core.config import load_config

    model = dataclasses.asdict(load_config(args.async_cfg).model)
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="bench-async-", dir=args.keep) as work:
            cfg = _config(args.colocate, work, args.steps, model=model)
            results["colocate"].append(run_colocate(cfg, work))
            _report("colocate", r, results["colocate"][-1], cores)
            for name in chosen:
                cfg = _config(args.async_cfg, work, args.steps, **variants[name])
                results[name].append(run_async(cfg, work))
                _report(name, r, results[name][-1], cores)
    best = chosen[0]
    # Time to the same accuracy: when each run's held-out eval first reaches what colocate
    # ends with (evals every train.eval_every steps, so this is as fine as that grid).
    target = statistics.median(x["accuracy"] for x in results["colocate"])
    reach = {name: [_time_to(x, target) for x in runs] for name, runs in results.items()}
    colocate = statistics.median(reach["colocate"])
    wall = statistics.median(reach[best])
    same_steps = statistics.median(x["wall_s"] for x in results["colocate"]) / statistics.median(
        x["wall_s"] for x in results[best]
    )
    per_step = (
        results["colocate"][-1]["per_step"]["perf/step_s"]
        / results[best][-1]["per_step"]["perf/step_s"]
    )
    bound = statistics.median(x["cpu_s"] / cores for x in results[best])
    full_wall = statistics.median(x["wall_s"] for x in results[best])
    print(f"\ncores: {cores}; steps: {args.steps}; rounds: {args.rounds}")
    for name, runs in results.items():
        print(
            f"{name:>10}: wall {statistics.median(x['wall_s'] for x in runs):7.1f} s, "
            f"cpu {statistics.median(x['cpu_s'] for x in runs):7.1f} s, final accuracy "
            f"{', '.join(format(x['accuracy'], '.3f') for x in runs)}"
        )
    _projection(results[best][-1], results["colocate"][-1])
    for name, times in reach.items():
        print(f"time to accuracy {target:.3f}: {name} {', '.join(f'{t:.1f} s' for t in times)}")
    print(
        f"same {args.steps} steps: colocate / {best} wall = {same_steps:.2f}; per step "
        f"(median s/step) = {per_step:.2f}"
    )
    print(f"headline: async_speedup = {colocate / wall:.2f}")
    print(f"headline: machine_bound_ratio = {full_wall / bound:.2f}")


def _time_to(run: dict, target: float) -> float:
    """Seconds into the timed phase of the first eval at or above `target` (the whole phase
    when none reaches it)."""
    for _, value, seconds in run["eval_times"]:
        if value >= target - 1e-9:
            return seconds
    return run["wall_s"]


def _report(name: str, round_: int, res: dict, cores: int) -> None:
    per = ", ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in res["per_step"].items())
    print(
        f"[{name} round {round_}] wall {res['wall_s']:.1f} s, cpu {res['cpu_s']:.1f} s "
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
    c = colocate_run["per_step"]
    print(
        f"projection, one device per role: trainer busy {trainer:.3f} s/step, rollout busy "
        f"{rollout:.3f} s/step -> async {max(trainer, rollout):.3f} s/step vs the same roles "
        f"in sequence {trainer + rollout:.3f} s/step ({(trainer + rollout) / max(trainer, rollout):.2f}x); "
        f"colocate here: {c.get('perf/step_s', 0.0):.3f} s/step"
    )


if __name__ == "__main__":
    main()
