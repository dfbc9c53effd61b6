"""Elastic rollout: one async CPU run scaled out from 1 to N engines and back in, mid-run.

The run is `configs/cpu-async.yaml` (overrides below), a whole local run in a child process
(`python -m` of `bench.common.LAUNCHER`: the local launcher and its scaling API). Through the API
(`ScaleClient`, what `relax scale` uses), when the trainer reaches a third of `--steps` the pool
grows to `--engines`, and at two thirds it shrinks back to 1. Rollout throughput is measured per
phase from the rollout stage's own commit records (groups and generated tokens committed per
second of wall time), in the same run: 1 engine, N engines (after every new engine takes work),
1 engine again (after the drain). Then the exactly-once audit counts groups lost or trained twice.

Each round is a whole run of its own (`--rounds`); this process and the run it starts (every
role process) are pinned to one CPU set (`--cpus`), the roles sharing it as the config's services
section says.

    python bench/elastic.py [--rounds 3] [--steps 300] [--engines 3] [--max-new-tokens 32]
        [--staleness 4] [--cpus 0,1]

Rollout is the bottleneck this measures only when generation, not training, limits the run:
`--max-new-tokens` sets how long responses may be (the default task answers in a few tokens,
where the trainer is the bottleneck on 2 cores and more engines only wait at the staleness
bound). Last lines: `headline: scale_out_throughput_ratio = X` (groups/s with N engines over
1 engine in the same run, the median over rounds; min-max on the line before) and
`headline: lost_or_duplicated = N` (rows, summed over rounds).
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
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import cpu_set, print_headline, start_local_run, work_sections, write_config


def _config(work: str, args: argparse.Namespace) -> str:
    from relax_core.config import load_config, replace

    cfg = replace(
        load_config(os.path.join(REPO, "configs", "cpu-async.yaml")),
        run_name="elastic",
        rollout={"max_new_tokens": args.max_new_tokens, "max_staleness": args.staleness},
        warm_start={"steps": args.warm_start_steps},
        train={"total_steps": args.steps, "checkpoint_every": args.steps, "eval_every": 0},
        **work_sections(work),
        reward={"name": "bench.remote_verifier:score" if args.reward_latency_ms else "math"},
        services={
            "max_rollout_workers": max(args.engines, 1),
            "rollout_batch_groups": args.batch_groups,
        },
    )
    return write_config(cfg, os.path.join(work, "elastic.json"))


def _wait(what: str, check, proc: subprocess.Popen, timeout: float = 900.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            sys.exit(f"the run ended before {what}")
        time.sleep(0.1)
    sys.exit(f"timed out waiting for {what}")


def _version(queue) -> int:
    beats = [b for b in queue.heartbeats() if b["role"] == "trainer"]
    return max((b["info"].get("policy_version", 0) for b in beats), default=0)


def _phase(records: list[dict], start: float, end: float) -> dict[str, float]:
    """Groups and generated tokens committed to the rollout stage in [start, end)."""
    inside = [r for r in records if start <= r["created"] < end]
    groups = sum(r["meta"]["tickets"][1] for r in inside)
    tokens = sum(r["meta"]["metrics"]["perf/generated_tokens"] for r in inside)
    waited = sum(r["meta"]["metrics"].get("perf/rollout_wait_s", 0.0) for r in inside)
    span = max(end - start, 1e-9)
    return {
        "s": span,
        "groups": groups,
        "groups_per_s": groups / span,
        "tokens_per_s": tokens / span,
        "wait_s": waited,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--staleness", type=int, default=4)
    parser.add_argument("--warm-start-steps", type=int, default=150)
    parser.add_argument(
        "--reward-latency-ms",
        type=float,
        default=0.0,
        help="score with bench/remote_verifier.py, waiting this long per sample",
    )
    parser.add_argument(
        "--batch-groups", type=int, default=0, help="groups per generate call (0: a step batch)"
    )
    parser.add_argument("--settle-s", type=float, default=3.0, help="skipped after each change")
    parser.add_argument("--rounds", type=int, default=3, help="whole runs, one after another")
    parser.add_argument("--cpus", default="", help="CPU set for every process (default: all)")
    args = parser.parse_args()
    cpus = cpu_set(args.cpus)
    os.sched_setaffinity(0, cpus)  # every run started below, and its roles, inherit it
    ratios, bad_rows = [], 0
    for r in range(args.rounds):
        print(f"\n## round {r} (CPUs {cpus})", flush=True)
        ratio, bad = one_round(args)
        ratios.append(ratio)
        bad_rows += bad
    print()
    print_headline("scale_out_throughput_ratio", ratios)
    print(f"headline: lost_or_duplicated = {bad_rows}")


def one_round(args: argparse.Namespace) -> tuple[float, int]:
    """One whole run scaled out and in; (groups/s with N engines over 1 engine, rows lost or
    trained twice)."""
    from relax_core.ops.scale_client import ScaleClient
    from relax_core.queue import TransferQueue
    from relax_core.queue.audit import audit_run
    from relax_core.train.checkpoint import find_resume_checkpoint, read_state

    work = tempfile.mkdtemp(prefix="relax-elastic-")
    log_path = os.path.join(work, "run.log")
    print(f"run: {args.steps} steps, work dir {work}", flush=True)
    latency = str(args.reward_latency_ms)
    proc = start_local_run(_config(work, args), log_path, RELAX_BENCH_REWARD_LATENCY_MS=latency)
    pattern = os.path.join(work, "checkpoints", "*", "scale_api.json")
    run_dir = os.path.dirname(_wait("the scaling API", lambda: glob.glob(pattern), proc)[0])
    queue = TransferQueue(os.path.join(work, "queue"), os.path.basename(run_dir))
    client = ScaleClient.for_run(run_dir)
    marks: dict[str, float] = {}

    _wait("step 5", lambda: _version(queue) >= 5, proc)
    marks["one_start"] = time.time()
    _wait(f"step {args.steps // 3}", lambda: _version(queue) >= args.steps // 3, proc)
    marks["out_asked"] = time.time()
    out = client.wait(client.scale_out(args.engines), poll_s=0.1)
    marks["out_done"] = time.time()
    out_s = marks["out_done"] - marks["out_asked"]
    print(f"scale out to {args.engines}: {out['status']} in {out_s:.1f} s")
    _wait(f"step {2 * args.steps // 3}", lambda: _version(queue) >= 2 * args.steps // 3, proc)
    marks["in_asked"] = time.time()
    drained = client.wait(client.scale_in(target=1), poll_s=0.1)
    marks["in_done"] = time.time()
    print(f"scale in to 1: {drained['status']} in {marks['in_done'] - marks['in_asked']:.1f} s")
    if proc.wait() != 0:
        sys.exit(f"the run failed; see {log_path}")
    marks["end"] = time.time()
    with open(os.path.join(work, "marks.json"), "w") as f:
        json.dump(marks, f)

    records = [queue.record("rollout", seq) for seq in queue.committed("rollout")]
    last = max(r["created"] for r in records)
    settle = args.settle_s
    phases = {
        "1 engine": _phase(records, marks["one_start"], marks["out_asked"]),
        f"{args.engines} engines": _phase(records, marks["out_done"] + settle, marks["in_asked"]),
        "1 engine again": _phase(records, marks["in_done"] + settle, last),
    }
    state = read_state(find_resume_checkpoint(os.path.join(work, "checkpoints"), "elastic"))
    audit = audit_run(queue, state)
    by_worker: dict[str, int] = {}
    for r in records:
        by_worker[r["meta"]["worker"]] = (
            by_worker.get(r["meta"]["worker"], 0) + r["meta"]["tickets"][1]
        )

    print(
        "\n| phase | wall (s) | groups committed | groups/s | generated tokens/s | "
        "engine-s waiting at the staleness bound |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, p in phases.items():
        print(
            f"| {name} | {p['s']:.1f} | {p['groups']} | {p['groups_per_s']:.1f} | "
            f"{p['tokens_per_s']:.0f} | {p['wait_s']:.1f} |"
        )
    print(f"\ngroups per engine: {json.dumps(by_worker)}")
    print(f"scale out took {out_s:.1f} s (start, join, first weights)")
    print(f"scale in took {marks['in_done'] - marks['in_asked']:.1f} s (drain)")
    removed = set(drained["engines"])
    late = [
        r for r in records if r["meta"]["worker"] in removed and r["created"] >= marks["in_asked"]
    ]
    print(
        f"groups the drained engines committed after the scale-in request (in flight when it "
        f"came): {sum(r['meta']['tickets'][1] for r in late)}"
    )
    print(f"audit (groups): {json.dumps(audit)}")
    one, many = phases["1 engine"], phases[f"{args.engines} engines"]
    with open(os.path.join(work, "elastic.json")) as f:
        samples = json.load(f)["rollout"]["n_samples_per_prompt"]  # rows per group
    bad = audit["lost_groups"] + audit["duplicated_groups"]
    ratio = many["groups_per_s"] / one["groups_per_s"]
    print(f"scale_out_throughput_ratio = {ratio:.2f}; lost_or_duplicated = {bad * samples}")
    return ratio, bad * samples


if __name__ == "__main__":
    main()
