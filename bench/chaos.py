"""Chaos: an async CPU run while a random role is SIGKILLed every ~30 s, against the same run
left alone.

Both runs are `configs/cpu-async.yaml` for `--steps` steps (checkpoints every 20), from the same
cached warm-started policy, one after the other on this machine, each a whole local run in a
child process (`python -m` of `bench.common.LAUNCHER`: the local supervisor restarts what dies).
During the chaos run a seeded random role (trainer, rollout or advantages) is killed every
`--every` seconds (+-30%). After it, the queue's exactly-once audit (`audit_run`) counts groups
lost (committed by rollout, neither trained nor still queued) and groups trained twice.

    python bench/chaos.py [--steps 100] [--every 30] [--seed 0]

Prints both runs' final held-out accuracy and training wall time, the kills, the supervisor's
restarts, the audit, and last `headline: lost_or_duplicated = N` (rows: groups x samples).
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
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import start_local_run, work_sections, write_config

VICTIMS = ("trainer", "rollout", "advantages")


def _config(work: str, name: str, steps: int) -> str:
    from relax_core.config import load_config, replace

    cfg = replace(
        load_config(os.path.join(REPO, "configs", "cpu-async.yaml")),
        run_name=name,
        train={"total_steps": steps, "checkpoint_every": 20, "eval_every": 25},
        **work_sections(work),
    )
    return write_config(cfg, os.path.join(work, f"{name}.json"))


def _live_roles(work: str) -> dict[str, int]:
    """role -> pid of the newest heartbeat of each live service of the run."""
    from relax_core.queue import TransferQueue

    root = os.path.join(work, "queue")
    found: dict[str, int] = {}
    for run_id in os.listdir(root) if os.path.isdir(root) else []:
        for beat in TransferQueue(root, run_id).heartbeats():
            if beat["info"].get("state") not in ("stopped", "starting"):
                found[beat["role"]] = int(beat["info"]["pid"])
    return found


def _chaos(proc: subprocess.Popen, work: str, every: float, rng: random.Random) -> list[dict]:
    kills = []
    next_at = time.monotonic() + every * rng.uniform(0.7, 1.3)
    while proc.poll() is None:
        time.sleep(0.2)
        if time.monotonic() < next_at:
            continue
        live = _live_roles(work)
        candidates = [r for r in VICTIMS if r in live]
        if not candidates:
            continue
        role = rng.choice(candidates)
        try:
            os.kill(live[role], signal.SIGKILL)
        except ProcessLookupError:
            continue
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--every", type=float, default=30.0, help="seconds between kills")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from relax_core.queue import TransferQueue
    from relax_core.queue.audit import audit_run

    work = tempfile.mkdtemp(prefix="relax-chaos-")
    rng = random.Random(args.seed)
    runs = {}
    for name, chaos in (("calm", False), ("chaos", True)):
        print(f"{name}: {args.steps} steps", flush=True)
        proc = start_local_run(_config(work, name, args.steps), os.path.join(work, f"{name}.log"))
        kills = _chaos(proc, work, args.every, rng) if chaos else []
        if proc.wait() != 0:
            sys.exit(f"{name} run failed; see {os.path.join(work, name + '.log')}")
        summary, run_dir = _result(work, name)
        with open(os.path.join(run_dir, "recovery.json")) as f:
            recovery = json.load(f)
        queue = TransferQueue(os.path.join(work, "queue"), summary["run_id"])
        runs[name] = {
            "accuracy": summary["eval_accuracy_after"],
            "wall_s": summary["wall_time_s"],
            "kills": kills,
            "recovery": recovery,
            "audit": audit_run(queue, summary["state"]),
        }

    with open(os.path.join(work, "chaos.json")) as f:
        samples = json.load(f)["rollout"]["n_samples_per_prompt"]  # rows per group
    print("\n| run | final accuracy | wall (s) | kills | in-place restarts | whole-run restarts |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        restarts = sum(r["recovery"]["role_restarts"].values())
        kills = ", ".join(k["role"] for k in r["kills"]) or "-"
        print(
            f"| {name} | {r['accuracy']:.3f} | {r['wall_s']:.1f} | {kills} | {restarts} | "
            f"{r['recovery']['global_restarts']} |"
        )
    calm, chaos = runs["calm"], runs["chaos"]
    print(f"\naudit of the chaos run (groups): {json.dumps(chaos['audit'])}")
    print(f"accuracy difference: {100 * (chaos['accuracy'] - calm['accuracy']):+.1f} points")
    print(f"time lost to failures: {chaos['wall_s'] - calm['wall_s']:.1f} s")
    bad = chaos["audit"]["lost_groups"] + chaos["audit"]["duplicated_groups"]
    print(f"headline: lost_or_duplicated = {bad * samples}")


if __name__ == "__main__":
    main()
