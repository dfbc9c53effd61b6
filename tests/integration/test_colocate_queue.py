"""The colocate controller's rows still go through the queue: every stage's entry is committed
before the next role takes it, and what the trainer trains is exactly what a reader of the
queue decodes from that entry, although the controller passes it on in memory. An entry
another writer committed in between is read in order, as any consumer reads it."""

from __future__ import annotations

import pytest

from relax_core.config import load_config
from relax_core.data.dataset import fingerprint
from relax_core.queue import ROW_SCHEMA, rows_to_table
from relax_core.run import colocate
from relax_core.run.prepare import PolicySpec, prepare_policy
from relax_core.run.session import RunSession
from relax_core.train.run_state import RunState

pytestmark = [pytest.mark.integration]


@pytest.fixture
def controller(small_config, monkeypatch):
    cfg = load_config(small_config())
    policy = prepare_policy(
        PolicySpec.of(cfg, fingerprint(cfg.data.train_path)), cfg.checkpoint.policy_cache_dir
    )
    session = RunSession(cfg, policy, RunState(run_id="colocate-queue"))
    trained: list = []
    real = colocate.train_on_table

    def keep(backend, table, *args, **kwargs):
        trained.append(table)
        return real(backend, table, *args, **kwargs)

    monkeypatch.setattr(colocate, "train_on_table", keep)
    return colocate.ColocateController(session), trained


def test_each_step_commits_its_rows_and_trains_what_a_reader_decodes(controller):
    ctrl, trained = controller
    queue = ctrl.s.queue
    for _ in range(3):
        ctrl.step()
    assert queue.committed("rollout") == queue.committed("ready") == [0, 1, 2]
    assert ctrl.s.state.queue_cursors["rollout"] == ctrl.s.state.queue_cursors["ready"] == 2
    for seq, table in enumerate(trained):
        decoded = queue.read("ready", seq)
        assert decoded.schema.equals(ROW_SCHEMA, check_metadata=True)
        assert table.equals(decoded), seq
        assert queue.record("ready", seq)["meta"] == {"policy_version": seq}
    rollout = queue.read("rollout", 1)
    assert rollout.column("response_ids").equals(trained[1].column("response_ids"))


def test_an_entry_another_writer_committed_first_is_trained_first(controller):
    ctrl, trained = controller
    ctrl.step()
    queue = ctrl.s.queue
    foreign = queue.read("ready", 0).slice(0, 4)  # one whole group of 4 samples
    foreign_rows = foreign.to_pylist()
    queue.put("ready", rows_to_table(foreign_rows), {"policy_version": 1})
    ctrl.step()
    assert trained[1].num_rows == 4
    assert trained[1].column("response_ids").to_pylist() == [
        r["response_ids"] for r in foreign_rows
    ]
    # The step's own entry waits after the cursor, in order, for the next consumer's read.
    assert ctrl.s.state.queue_cursors["ready"] == 1
    assert queue.committed("ready", 1) == [2]
