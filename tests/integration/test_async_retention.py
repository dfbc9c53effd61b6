"""An async CPU run prunes its queue as it goes: the trainer deletes what every kept checkpoint
has trained, a killed rollout worker and a killed trainer restart over a pruned queue without
waiting on or generating again what was deleted, and at the end the queue holds a few steps of
entries and the audit is clean."""

from __future__ import annotations

import pytest

from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.train.checkpoint import read_state
from tests.integration.test_async_run import (
    ASYNC,
    _final,
    _finish,
    _kill_on_plan,
    _run,
)

pytestmark = pytest.mark.integration


def test_a_pruned_async_run_restarts_and_ends_bounded_and_audited(small_config, workdir):
    steps, every, g = 36, 3, 4
    cfg = small_config(
        "r.yaml",
        run_name="r",
        mode="async",
        rollout={"max_staleness": 1, "groups_per_step": g},
        algorithm={"proximal": "behaviour"},
        train={"total_steps": steps, "checkpoint_every": every, "keep_checkpoints": 2},
        queue={"keep_versions": 1},
        services=ASYNC["services"],
    )
    proc = _run(cfg)
    # rollout after several passes (its restart must not void blocks whose entries are gone),
    # then the trainer (its restart must not wait for versions whose entries are gone).
    killed = _kill_on_plan(proc, workdir, [("rollout", 14), ("trainer", 25)])
    assert killed == ["rollout", "trainer"], killed
    _finish(proc)

    state = read_state(_final(workdir, "r"))
    assert state["policy_version"] == steps
    queue = TransferQueue(".relax/queue", state["run_id"])
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == steps * g and audit["trained_but_never_generated"] == 0
    # Kept at the end: what the older kept checkpoint (step 33) had not trained, and what
    # rollout generated ahead (max_staleness 1): a handful of the run's 36+ entries per stage.
    assert audit["pruned_groups"] >= 30 * g
    for stage in ("rollout", "ready"):
        assert 1 <= len(queue.committed(stage)) <= 2 * every + 2, queue.committed(stage)
    assert queue.quarantined("rollout") == queue.quarantined("ready") == []
