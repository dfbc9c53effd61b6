"""Pod rehearsal of an async run: the `train` workflow with `services.launch: tasks` (cpu-async,
shortened), every task and role in a pod of its own (tests/rehearsal; what a pod is and why:
test_pod_rehearsal.py). Rollout, advantages and trainer pods run side by side; the trainer is
killed after its first checkpoint and rerun; the others end on their own, and the exactly-once
audit (in a pod of its own) finds nothing lost or trained twice.

A file of its own, with its own cluster, so that it runs beside the colocate rehearsal.
"""

from __future__ import annotations

import pytest

from tests.rehearsal.driver import kill_after, newer_checkpoint
from tests.rehearsal.runs import (
    ROOT_PREFIX,
    logged_steps,
    rehearsal_cluster,  # noqa: F401  (the `cluster` fixture, one per module)
    rehearsal_config,
)


@pytest.mark.integration
@pytest.mark.slow
def test_async_tasks_run_in_pods_survives_a_killed_trainer_and_audits_clean(cluster) -> None:
    from workflows.train import train

    total, groups = 20, 32
    cfg = rehearsal_config(
        cluster,
        "cpu-async.yaml",
        train={"total_steps": total, "checkpoint_every": 5, "eval_every": 0},
        data={"eval_size": 128},  # no accuracy claim here: a shorter eval
        rollout={"groups_per_step": groups},
        services={"launch": "tasks"},
    )
    root = cluster.storage_root(ROOT_PREFIX)
    faults = [kill_after("trainer_service", newer_checkpoint())]
    rehearsal = cluster.rehearsal(root, faults=faults, grace_s=90)
    result = rehearsal.run(train, {"cfg": cfg})

    summary = result.outputs["o0"]
    assert summary["steps"] == total, summary
    trainers = result.pods_of("trainer_service")
    assert [r.killed for r in trainers] == [True, False], [(r.pod, r.killed) for r in trainers]
    for role in ("rollout_service", "advantages_service"):  # they ended on their own
        assert [r.killed for r in result.pods_of(role)] == [False], role
    audit = rehearsal.call(
        "tests.rehearsal.checks:queue_audit",
        {
            "cfg_json": result.pods_of("prepare_data")[0].outputs["cfg_json"],
            "checkpoint": summary["checkpoint"],
        },
    )
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == total * groups, audit
    assert audit["trained_but_never_generated"] == 0, audit
    status, logged = cluster.on_ctl(
        logged_steps, cluster.tracking_uri, summary["mlflow_run_id"], "train/reward_mean"
    )
    assert status == "FINISHED" and set(range(1, total + 1)) <= logged, sorted(logged)
