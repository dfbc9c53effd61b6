"""Chaos: async CPU runs with every role, the trainer first, SIGKILLed at random, against calm runs.

The runs are audited from the queue and the dataset, not from the trainer's own records.

Per seed of `--seeds`, two runs of `configs/cpu-async.yaml` with that seed for `--steps` steps
(checkpoints every 20), one after the other on this machine, each a whole local run in a child
process (`python -m` of `bench.common.LAUNCHER`: the local supervisor restarts what dies), from
the seed's cached warm-started policy: calm, then chaos. In the chaos run the trainer is killed
at step 25 (after its first checkpoint), then a role drawn from trainer, rollout and advantages
with a generator seeded by the seed every `--every` seconds (+-30%). No role is killed more
than `services.max_role_restarts` times (3 by default, counted within `restart_window_s`, 30 min,
longer than a run), so every restart is one in place and the run never spends its budget; the
CPU default's 100 steps last about 25 s calm on a quiet machine, and a kill every ~6 s gives
each chaos run 4-5 kills (each restart costs ~5 s), the trainer's included.

Two audits of every run: the groups (`audit_run`: every group rollout committed trained once or
still queued) and the prompts (`read_prompt_coverage`: every prompt of the dataset stream up to
the run's end trained once per epoch or still queued, from the tickets, the dataset's order, the
rows and the trainer's write-once step log; neither `control/trained` nor the checkpoint).

    python bench/chaos.py [--seeds 0,1,2] [--steps 100] [--every 6]

Prints a table per run (final held-out accuracy, training wall time, kills, restarts, both
audits), chaos minus calm accuracy per seed, and last `headline: lost_or_duplicated = N` (rows:
groups x samples, over every chaos run) and `headline: prompt_coverage_errors = N` (prompts
missing, trained twice or out of stream, over every chaos run).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import json
import random
import signal
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import start_local_run, work_sections, write_config

VICTIMS = ("trainer", "rollout", "advantages")


def _config(work: str, name: str, steps: int, seed: int):
    from relax_core.config import load_config, replace

    return replace(
        load_config(os.path.join(REPO, "configs", "cpu-async.yaml")),
        run_name=name,
        seed=seed,
        train={"total_steps": steps, "checkpoint_every": 20, "eval_every": 25},
        **work_sections(work),
    )


def _live_roles(work: str) -> tuple[dict[str, int], int]:
    """(role -> pid of the newest heartbeat of each live service of the run, the policy version
    the trainer's heartbeat reports)."""
    from relax_core.queue import TransferQueue

    root = os.path.join(work, "queue")
    found: dict[str, int] = {}
    version = 0
    for run_id in os.listdir(root) if os.path.isdir(root) else []:
        for beat in TransferQueue(root, run_id).heartbeats():
            if beat["info"].get("state") not in ("stopped", "starting"):
                found[beat["role"]] = int(beat["info"]["pid"])
            if beat["role"] == "trainer":
                version = max(version, int(beat["info"].get("policy_version") or 0))
    return found, version


def _chaos(
    proc: subprocess.Popen, work: str, every: float, rng: random.Random, per_role: int, first: int
) -> list[dict]:
    """Kill the trainer once its heartbeat reports version `first`, then a live victim drawn
    at random every `every` s (+-30%), none more than `per_role` times."""
    kills: list[dict] = []
    dead: set[int] = set()  # a killed pid whose heartbeat is still the newest (not reaped yet)
    next_at = None
    while proc.poll() is None:
        time.sleep(0.2)
        roles, version = _live_roles(work)
        live = {r: pid for r, pid in roles.items() if pid not in dead}
        if next_at is None:
            # By version, not by seconds: a fast run would otherwise end before the first kill.
            if "trainer" in live and version >= first:
                next_at = time.monotonic()
            continue
        if time.monotonic() < next_at:
            continue
        done = [k["role"] for k in kills]
        candidates = [r for r in VICTIMS if r in live and done.count(r) < per_role]
        if not kills:
            candidates = [r for r in candidates if r == "trainer"]
        if not candidates:
            continue
        role = rng.choice(candidates)
        try:
            os.kill(live[role], signal.SIGKILL)
        except ProcessLookupError:
            continue
        dead.add(live[role])
        kills.append({"role": role, "pid": live[role], "t": round(time.monotonic(), 1)})
        print(f"  killed {role} (pid {live[role]})", flush=True)
        next_at = time.monotonic() + every * rng.uniform(0.7, 1.3)
    return kills


def _result(work: str, name: str) -> tuple[dict, str]:
    from relax_core.train.checkpoint import find_resume_checkpoint, read_state

    ckpt = find_resume_checkpoint(os.path.join(work, "checkpoints"), name)
    run_dir = os.path.dirname(ckpt)
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    summary["state"] = read_state(ckpt)
    return summary, run_dir


def _run(cfg, work: str, every: float | None, rng: random.Random) -> dict:
    """One whole run (killed at random when `every` is set) and both audits of it."""
    from relax_core.data import PromptSampler, load_prompts
    from relax_core.queue import TransferQueue
    from relax_core.queue.audit import audit_run
    from relax_core.queue.coverage import coverage_errors, read_prompt_coverage

    name = cfg.run_name
    print(f"{name}: {cfg.train.total_steps} steps, seed {cfg.seed}", flush=True)
    path = write_config(cfg, os.path.join(work, f"{name}.json"))
    proc = start_local_run(path, os.path.join(work, f"{name}.log"))
    per_role = cfg.services.max_role_restarts
    # The trainer's first kill comes after its first checkpoint (every 20 steps): it costs the
    # steps since then.
    first = min(25, cfg.train.total_steps // 2)
    kills = _chaos(proc, work, every, rng, per_role, first) if every else []
    if proc.wait() != 0:
        sys.exit(f"{name} run failed; see {os.path.join(work, name + '.log')}")
    summary, run_dir = _result(work, name)
    with open(os.path.join(run_dir, "recovery.json")) as f:
        recovery = json.load(f)
    queue = TransferQueue(os.path.join(work, "queue"), summary["run_id"])
    sampler = PromptSampler(
        len(load_prompts(os.path.join(REPO, cfg.data.train_path))),
        seed=cfg.seed,
        shuffle=cfg.data.shuffle,
    )
    audit = audit_run(queue, summary["state"])
    coverage = read_prompt_coverage(queue, sampler.num_prompts, sampler.order)
    samples = cfg.rollout.n_samples_per_prompt  # rows per group
    return {
        "accuracy": summary["eval_accuracy_after"],
        "wall_s": summary["wall_time_s"],
        "kills": kills,
        "recovery": recovery,
        "audit": audit,
        "bad_rows": (audit["lost_groups"] + audit["duplicated_groups"]) * samples,
        "coverage": coverage,
        "coverage_errors": coverage_errors(coverage),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated run and kill seeds")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=float, default=6.0, help="seconds between kills")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    root = tempfile.mkdtemp(prefix="relax-chaos-")
    print(f"work directory: {root}", flush=True)
    runs: dict[tuple[int, str], dict] = {}
    for seed in seeds:
        for kind in ("calm", "chaos"):
            work = os.path.join(root, f"{kind}-s{seed}")  # one queue root per run
            os.makedirs(work)
            cfg = _config(work, f"{kind}-s{seed}", args.steps, seed)
            every = args.every if kind == "chaos" else None
            runs[seed, kind] = _run(cfg, work, every, random.Random(seed))
            with open(os.path.join(root, "chaos.json"), "w") as f:
                json.dump({f"{k}-s{s}": r for (s, k), r in runs.items()}, f, indent=1)

    print(
        "\n| seed | run | final accuracy | wall (s) | kills | in-place restarts | "
        "whole-run restarts | lost or duplicated (rows) | prompt coverage errors |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (seed, kind), r in runs.items():
        restarts = sum(r["recovery"]["role_restarts"].values())
        kills = ", ".join(k["role"] for k in r["kills"]) or "-"
        print(
            f"| {seed} | {kind} | {r['accuracy']:.3f} | {r['wall_s']:.1f} | {kills} | "
            f"{restarts} | {r['recovery']['global_restarts']} | {r['bad_rows']} | "
            f"{r['coverage_errors']} |"
        )
    print()
    for (seed, kind), r in runs.items():
        print(f"seed {seed} {kind}: groups {json.dumps(r['audit'])}")
        print(f"seed {seed} {kind}: prompts {json.dumps(r['coverage'])}")
    diffs = [100 * (runs[s, "chaos"]["accuracy"] - runs[s, "calm"]["accuracy"]) for s in seeds]
    lost = [runs[s, "chaos"]["wall_s"] - runs[s, "calm"]["wall_s"] for s in seeds]
    print(
        "\naccuracy difference (chaos - calm, points): "
        + ", ".join(f"seed {s} {d:+.1f}" for s, d in zip(seeds, diffs, strict=True))
        + f"; median {statistics.median(diffs):+.1f}, min {min(diffs):+.1f}, max {max(diffs):+.1f}"
    )
    print(
        "time lost to failures (s): "
        + ", ".join(f"seed {s} {t:+.1f}" for s, t in zip(seeds, lost, strict=True))
    )
    chaos = [runs[s, "chaos"] for s in seeds]
    print(f"headline: lost_or_duplicated = {sum(r['bad_rows'] for r in chaos)}")
    print(f"headline: prompt_coverage_errors = {sum(r['coverage_errors'] for r in chaos)}")


if __name__ == "__main__":
    main()
