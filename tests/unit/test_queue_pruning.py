"""Pruning a run's queue on local disk: a run-shaped async queue (admission, a rollout worker,
an advantages worker, the trainer's ready pool, checkpoints) stays bounded, and everything that
reads old entries still works after they are deleted, or while they are being deleted: the
audit, a restarted trainer and rollout worker, a stage worker with a stale listing, a reader
that holds a record whose payload goes."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from relax_core.queue import AdmissionLedger, StageWorker, TransferQueue, rows_to_table
from relax_core.queue.audit import audit_run, record_trained
from relax_core.queue.inspect import render, summarize
from relax_core.queue.pruning import prune, pruned_ranges, summaries
from relax_core.queue.retention import consumer_positions
from relax_core.roles.ready_pool import ReadyPool
from relax_core.roles.rollout_service import committed_blocks


class RunShape:
    """An async run on one queue, step by step: rollout admits and commits `groups` groups under
    the current version, advantages turns each rollout entry into a ready entry at its seq, the
    trainer takes a step batch, and every `every` steps a checkpoint is kept (the newest `keep`)
    and the queue is pruned, as the trainer service does."""

    def __init__(self, queue, groups=2, every=2, keep=2, keep_versions=1, retention="prune"):
        self.queue, self.groups, self.every, self.keep = queue, groups, every, keep
        self.keep_versions, self.retention = keep_versions, retention
        self.ledger = AdmissionLedger(queue)
        self.worker = StageWorker(queue, "rollout", "ready", "advantages-0")
        self.pool = ReadyPool(SimpleNamespace(queue=queue), {"through": -1, "beyond": []})
        self.kept = [self.state(0)]
        self.version = 0

    def state(self, version: int) -> dict:
        """What the trainer's checkpoint at `version` records."""
        return {"policy_version": version, "ready_cursor": self.pool.state()}

    def generate(self, worker: str = "rollout-0") -> int:
        v = self.version
        first, count = self.ledger.try_admit(self.groups, v, 1, self.groups, worker=worker)
        assert count == self.groups
        rows = [
            {
                "uid": f"t{first + g}-s{i}",
                "group_id": f"t{first + g}",
                "response_ids": list(range(16)),
                "behaviour_version_min": v,
                "behaviour_version_max": v,
            }
            for g in range(count)
            for i in range(2)
        ]
        meta = {"policy_version": v, "tickets": [first, count], "worker": worker}
        return self.queue.put("rollout", rows_to_table(rows), meta)

    def transform(self) -> None:
        for lease, entry in self.worker.claim():
            self.worker.complete(lease, entry.table, meta=entry.record.get("meta"))

    def train(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (chosen := self.pool.select(self.groups, False)) is None:
            assert time.monotonic() < deadline, "the step batch never arrived in ready"
            self.pool.refresh()
        batch = self.pool.take(chosen)
        self.version += 1
        record_trained(self.queue, self.version, sorted(set(batch.column("group_id").to_pylist())))
        if self.version % self.every == 0:
            self.kept = [*self.kept, self.state(self.version)][-self.keep :]
            if self.retention == "prune":
                self.prune()

    def prune(self) -> dict:
        positions = consumer_positions(self.kept, "async")
        return prune(self.queue, positions, self.version, self.keep_versions, aligned=True)

    def step(self) -> None:
        self.generate()
        self.transform()
        self.train()


def _objects(root: str, *prefixes: str) -> list[str]:
    out = []
    for prefix in prefixes:
        for base, _, files in os.walk(os.path.join(root, prefix)):
            out += [os.path.join(base, f) for f in files]
    return out


def test_a_long_run_keeps_a_bounded_window_and_the_audit_accounts_for_the_rest(tmp_path):
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)  # payloads in data/ too
    run = RunShape(queue)
    counts = []
    for _ in range(40):
        run.step()
        counts.append(len(_objects(str(tmp_path / "run"), "log", "data", "claims")))
    # Per step: 2 records, 2 payloads, 1 claim. Checkpoints every 2 steps, 2 kept: what the
    # older one had not trained (2 steps) and the step since the newer one stay, 3 steps at most
    # however long the run (keep_versions 1 keeps less than that here).
    assert counts[:4] == [5, 10, 15, 10] and max(counts) == 3 * 5
    assert queue.committed("rollout")[0] > 30 and queue.quarantined("rollout") == []
    final = run.state(run.version)
    audit = audit_run(queue, final)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_but_never_generated"] == 0
    assert audit["trained_groups"] == audit["generated_groups"] == 80
    assert audit["pruned_groups"] == 2 * audit["pruned_entries"] > 60
    text = render(summarize(queue))
    assert "deleted by retention" in text and "rollout" in text


def test_keep_retention_deletes_nothing(tmp_path):
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    run = RunShape(queue, retention="keep")
    for _ in range(12):
        run.step()
    assert len(queue.committed("rollout")) == len(queue.committed("ready")) == 12
    assert not os.path.exists(tmp_path / "run" / "pruned")


def test_the_newest_entry_stays_so_a_fresh_writer_never_reuses_a_seq(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    run = RunShape(queue, keep=1, keep_versions=0)
    for _ in range(6):
        run.step()
    assert queue.committed("rollout") == [5] and queue.committed("ready") == [5]
    fresh = TransferQueue(str(tmp_path), "run")  # a restarted rollout worker
    assert fresh.put("rollout", rows_to_table([{"uid": "x-0", "group_id": "x"}])) == 6


def test_a_restarted_trainer_and_rollout_worker_account_for_pruned_entries(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    run = RunShape(queue, keep=1, keep_versions=0)
    for _ in range(8):
        run.step()
    run.generate()  # admitted and committed, not yet trained
    assert pruned_ranges(queue.store, "ready")
    # The trainer restarts from its newest checkpoint: the versions whose entries were deleted
    # are not "still generating" (it would wait for them forever), and it trains on.
    resumed = ReadyPool(SimpleNamespace(queue=queue), run.kept[-1]["ready_cursor"])
    run.transform()
    resumed.refresh()
    assert resumed.in_flight_versions() == []
    assert resumed.select(2, False) == ["t16", "t17"]
    # The rollout worker restarts: its blocks in deleted entries were committed, not lost, so
    # nothing is voided and generated again.
    blocks = committed_blocks(queue)
    assert sorted(blocks) == list(range(0, 18, 2))
    assert run.ledger.reclaim("rollout-0", set(blocks)) == []


def test_a_stage_worker_with_a_stale_listing_skips_what_was_pruned(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    run = RunShape(queue, keep=1, keep_versions=0)
    late = StageWorker(queue, "rollout", "ready", "advantages-1")
    for _ in range(6):
        run.generate()
        run.transform()
        # It lists the inputs (all taken), not their outputs, and remembers them. After a
        # checkpoint the oldest have no lease any more, so it takes one: the entry is gone,
        # and it passes over it: no crash, no work, no output written again.
        assert list(late.claim()) == []
        run.train()
    assert pruned_ranges(queue.store, "rollout")
    assert list(late.claim()) == []
    assert queue.committed("ready") == [5] and queue.quarantined("rollout") == []
    assert os.listdir(tmp_path / "run" / "claims" / "rollout") == ["00000000000000000005-0000"]


def test_a_reader_holding_a_record_whose_payload_is_pruned_does_not_quarantine_it(
    tmp_path, monkeypatch
):
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    run = RunShape(queue, keep=1, keep_versions=0)
    for _ in range(3):
        run.step()
    reader = TransferQueue(str(tmp_path), "run")
    read_bytes = reader.store.read_bytes

    def prune_between_record_and_payload(path: str) -> bytes:
        if path.startswith("data/"):
            run.step()
            run.step()  # a checkpoint: the entry being read is deleted now
        return read_bytes(path)

    monkeypatch.setattr(reader.store, "read_bytes", prune_between_record_and_payload)
    with pytest.raises(FileNotFoundError, match="rollout entry 1 was pruned"):
        reader.entry("rollout", 1)
    monkeypatch.setattr(reader.store, "read_bytes", read_bytes)
    assert reader.quarantined("rollout") == [] and not os.path.exists(tmp_path / "run/quarantine")
    seq, _ = reader.next("rollout", 1)  # a consumer passes over it to the entries kept
    assert seq == queue.committed("rollout")[0]


def test_a_pass_cut_short_is_finished_by_the_next(tmp_path, monkeypatch):
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    run = RunShape(queue, keep=1, keep_versions=0, retention="keep")
    for _ in range(6):
        run.step()
    delete_many = queue.store.delete_many

    def die_after_records(paths: list[str]) -> None:
        delete_many(paths)
        if paths and paths[0].startswith("log/"):
            raise OSError("killed")

    monkeypatch.setattr(queue.store, "delete_many", die_after_records)
    with pytest.raises(OSError):
        run.prune()  # records of rollout gone, their payloads not
    monkeypatch.setattr(queue.store, "delete_many", delete_many)
    run.generate()
    run.transform()
    run.train()
    run.prune()
    named = {
        queue.record(s, q)["payload"] for s in ("rollout", "ready") for q in queue.committed(s)
    }
    on_disk = {
        os.path.relpath(p, tmp_path / "run") for p in _objects(str(tmp_path / "run"), "data")
    }
    assert on_disk == named  # no payload left behind without a record
    assert [s["last"] for s in summaries(queue.store, "rollout")] == [4, 5]


def test_a_writer_that_loses_a_commit_race_deletes_its_payload(tmp_path):
    a = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    b = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    table = rows_to_table([{"uid": "g-0", "group_id": "g"}])
    assert a.commit("ready", 3, table) and not b.commit("ready", 3, table)
    assert len(os.listdir(tmp_path / "run" / "data" / "ready")) == 1
    assert a.read("ready", 3).equals(table)


def test_a_colocate_run_prunes_each_stage_by_its_own_cursor(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    cursors = {"rollout": -1, "ready": -1}

    def step(v: int) -> None:
        rows = [
            {"uid": f"v{v}-{i}", "group_id": f"v{v}", "behaviour_version_min": v} for i in (0, 1)
        ]
        for stage in ("rollout", "ready"):  # the controller writes, then reads back, each stage
            queue.put(stage, rows_to_table(rows), {"policy_version": v})
            cursors[stage], _ = queue.next(stage, cursors[stage])

    for v in range(3):
        step(v)
    # A rollout entry written after the checkpoint by a process that died; the resumed
    # controller skips it (skip_orphans), so the stages' seqs part ways.
    queue.put("rollout", rows_to_table([{"uid": "o-0", "group_id": "o"}]), {"policy_version": 3})
    cursors["rollout"] += 1
    for v in range(3, 8):
        step(v)
    state = {"policy_version": 8, "queue_cursors": dict(cursors)}
    prune(queue, consumer_positions([state], "colocate"), 8, 0, aligned=False)
    assert queue.committed("rollout") == [8] and queue.committed("ready") == [7]
    step(8)  # and the run goes on where it was
    assert cursors == {"rollout": 9, "ready": 8}
