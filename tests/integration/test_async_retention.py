"""Killed roles in an async CPU run that prunes its queue as it goes, asserted many ways on one
run: rollout killed after the trainer's first prunes, the trainer killed between checkpoints
(it resumes from the older one and trains again what it had trained since), then rollout again
under the new trainer.

- each killed role restarts in place (the trainer from its newest checkpoint) and the run ends;
- the audit finds no group lost or trained twice, and from the dataset and the queue alone
  every prompt of the stream was trained once or is still queued;
- the trainer deletes what every kept checkpoint has trained: restarts over a pruned queue
  neither wait on nor generate again what was deleted, and at the end the queue holds a few
  steps of entries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from relax_core.queue import TransferQueue
from relax_core.train.checkpoint import read_state
from tests.conftest import workdir_for, write_small_config
from tests.integration.test_async_run import ASYNC, _beats, _final, _roles, _run

# The first test's bound covers the run (the module's fixture): six role processes, three of
# them restarts.
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(600)]

STEPS, EVERY, GROUPS = 30, 3, 4
PLAN = [("rollout", 8), ("trainer", 16), ("rollout", 23)]
"""(role, at trainer version): rollout after two prunes (its restart must not void blocks whose
entries are gone), the trainer past checkpoint 15 (its restart must not wait for versions whose
entries are gone), rollout under the restarted trainer."""


def _trainer_version(beats: list[dict]) -> int:
    return max([b["info"].get("policy_version", 0) for b in beats if b["role"] == "trainer"] or [0])


def _kill_on_plan(proc: subprocess.Popen, workdir, plan: list[tuple[str, int]]) -> list[str]:
    """SIGKILL each (role, at trainer version) of `plan` in order, once the trainer's heartbeat
    reaches that version; returns the roles killed."""
    plan, killed = list(plan), []
    deadline = time.time() + 400
    while plan and proc.poll() is None and time.time() < deadline:
        role, at = plan[0]
        beats = _beats(workdir)
        for beat in beats:
            if beat["role"] == role and _trainer_version(beats) >= at:
                os.kill(beat["info"]["pid"], signal.SIGKILL)
                killed.append(role)
                plan.pop(0)
                break
        time.sleep(0.02)
    return killed


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """The run, killed on PLAN and ended; what the tests read of it."""
    for where in workdir_for(tmp_path_factory, "killed"):
        cfg = write_small_config(
            where,
            "k.yaml",
            run_name="k",
            mode="async",
            rollout={"max_staleness": 1, "groups_per_step": GROUPS},
            algorithm={"proximal": "behaviour"},
            train={"total_steps": STEPS, "checkpoint_every": EVERY, "keep_checkpoints": 2},
            queue={"keep_versions": 1},
            services=ASYNC["services"],
        )
        proc = _run(cfg)
        try:
            killed = _kill_on_plan(proc, where, PLAN)
            out, _ = proc.communicate(timeout=240)
        finally:
            if proc.poll() is None:  # the supervisor stops its roles on SIGTERM
                proc.terminate()
                proc.communicate(timeout=120)
        assert killed == [role for role, _ in PLAN], (killed, out)
        assert proc.returncode == 0, out
        ckpt = _final(where, "k")
        state = read_state(ckpt)
        yield SimpleNamespace(
            where=where,
            cfg=cfg,
            run_dir=os.path.dirname(ckpt),
            state=state,
            queue=TransferQueue(str(where / ".relax" / "queue"), state["run_id"]),
        )


def test_killed_roles_restart_in_place_and_the_run_ends(run) -> None:
    assert run.state["policy_version"] == STEPS
    with open(os.path.join(run.run_dir, "recovery.json")) as f:
        recovery = json.load(f)
    assert recovery["role_restarts"] == {"rollout-0": 2, "trainer-0": 1}
    assert recovery["global_restarts"] == 0
    assert [e["failure"] for e in recovery["events"]] == ["exited with code -9"] * 3
    incarnations = [(r["role"], r["incarnation"]) for r in _roles(run.run_dir)]
    assert ("rollout", 2) in incarnations and ("trainer", 1) in incarnations


def test_no_group_is_lost_or_trained_twice(run) -> None:
    from relax_core.queue.audit import audit_run

    audit = audit_run(run.queue, run.state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == STEPS * GROUPS, audit
    assert audit["trained_but_never_generated"] == 0, audit


def test_every_prompt_of_the_stream_is_trained_once_or_still_queued(run) -> None:
    """From the dataset and the queue alone (not the trained records, not the cursor): the
    blocks the killed rollouts redid skipped no position of the stream."""
    from relax_core.config import load_config
    from relax_core.data import PromptSampler, load_prompts
    from relax_core.queue.coverage import coverage_errors, read_prompt_coverage

    train_path = os.path.join(run.where, load_config(run.cfg).data.train_path)
    sampler = PromptSampler(len(load_prompts(train_path)), seed=0)
    coverage = read_prompt_coverage(run.queue, sampler.num_prompts, sampler.order)
    assert coverage_errors(coverage) == 0 and coverage["never_issued"] == 0, json.dumps(coverage)
    assert coverage["trained_once"] == STEPS * GROUPS, coverage
    assert coverage["trained_steps"] == STEPS, coverage


def test_the_queue_is_pruned_as_it_goes_and_ends_with_a_few_steps(run) -> None:
    from relax_core.queue.audit import audit_run

    audit = audit_run(run.queue, run.state)
    # Kept at the end: what the older kept checkpoint (step STEPS - EVERY) had not trained, and
    # what rollout generated ahead (max_staleness 1): a handful of the run's entries per stage.
    assert audit["pruned_groups"] >= (STEPS - 2 * EVERY) * GROUPS, audit
    for stage in ("rollout", "ready"):
        committed = run.queue.committed(stage)
        assert 1 <= len(committed) <= 2 * EVERY + 2, (stage, committed)
    assert run.queue.quarantined("rollout") == run.queue.quarantined("ready") == []
