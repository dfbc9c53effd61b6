"""DAPO dynamic sampling in an async run: every role a real OS process, the queue on disk.

Rollout keeps drawing prompts until groups with differing rewards are ready; the groups it drops
free their admission slots (recorded under `tickets-void/`), so the run finishes, the trainer
never waits for a dropped group, the staleness bound holds, and every admitted ticket is either
a committed group or a dropped one, exactly once.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest

from relax_core.queue import AdmissionLedger, TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVICES = {"trainer_threads": 1, "poll_s": 0.002, "heartbeat_s": 0.2, "rollout_batch_groups": 2}


def _metrics(workdir, run_id: str, key: str) -> list[float]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    history = mlflow.tracking.MlflowClient().get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


def test_async_dynamic_sampling_trains_only_groups_with_differing_rewards(small_config, workdir):
    k, g, steps = 1, 4, 6
    cfg = small_config(
        "ds.yaml",
        run_name="ds",
        mode="async",
        # A longer warm start and digit-wise partial credit: about a quarter of this policy's
        # groups score all alike (the default 5 steps and `math` give almost only those).
        warm_start={"steps": 60, "lr": 0.01},
        reward={"name": "digits"},
        rollout={"dynamic_sampling": True, "max_staleness": k, "groups_per_step": g},
        algorithm={"is_mode": "tis"},
        train={"total_steps": steps, "checkpoint_every": 3},
        services=SERVICES,
    )
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "never arrived" not in out  # the trainer never waited out a dropped group

    final = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "ds")
    assert final is not None
    state = read_state(final)
    assert state["policy_version"] == steps
    queue = TransferQueue(".relax/queue", state["run_id"])

    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == steps * g and audit["trained_but_never_generated"] == 0

    # Every trained (indeed every committed) group has differing rewards.
    rewards: dict[str, list[float]] = {}
    for seq in queue.committed("ready"):
        table = queue.read("ready", seq)
        for gid, reward in zip(
            table.column("group_id").to_pylist(), table.column("reward").to_pylist(), strict=True
        ):
            rewards.setdefault(gid, []).append(reward)
    assert rewards and all(max(v) > min(v) for v in rewards.values())

    # Every admitted ticket is a committed group or a dropped one, never both, never neither.
    ledger = AdmissionLedger(queue)
    dropped = [gid for body in ledger.dropped().values() for gid in body["groups"]]
    committed = [
        gid
        for seq in queue.committed("rollout")
        for gid in set(queue.read("rollout", seq).column("group_id").to_pylist())
    ]
    assert dropped, "no group was dropped: pick settings with uninformative groups"
    assert len(set(dropped)) == len(dropped) and not set(dropped) & set(committed)
    assert len(dropped) + len(committed) == ledger.started()
    assert ledger.voided() == ledger.dropped()  # nothing voided but drops (no restarts)

    # The bound held over the groups kept: at every admission, and in the staleness trained.
    kept = {}  # first ticket of a committed block -> its groups kept
    for seq in queue.committed("rollout"):
        first = queue.record("rollout", seq)["meta"]["tickets"][0]
        kept[first] = len(set(queue.read("rollout", seq).column("group_id").to_pylist()))
    for first, body in ledger.blocks().items():
        kept_so_far = sum(n for f, n in kept.items() if f <= first)
        assert kept_so_far <= (body["policy_version"] + k + 1) * g, (first, body)
    run_id = state["tracking_run_id"]
    staleness = _metrics(workdir, run_id, "train/staleness_max")
    assert len(staleness) == steps and max(staleness) <= k
    # Drawn vs kept: the dropped groups show up in the rollout's metric, with colocate's name.
    filtered = _metrics(workdir, run_id, "rollout/filtered_groups")
    assert filtered and sum(filtered) > 0
    assert _metrics(workdir, run_id, "rollout/sampling_rounds")
