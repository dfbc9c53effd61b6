"""The queue as a bus between workers: keyed commits, leases, quarantine, cursors, retries."""

from __future__ import annotations

import json
import logging
import math

import fsspec
import pyarrow as pa
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from relax_core.queue import (
    RetryPolicy,
    StageCursor,
    StageWorker,
    StorageError,
    StorageUnavailable,
    TransferQueue,
    claims,
    rows_to_table,
    table_to_rows,
    with_columns,
)
from relax_core.queue import store as object_store
from relax_core.queue.retry import DEFAULT_OUTAGE_LIMIT_S, set_outage_limit
from relax_core.queue.store import ObjectStore
from tests.unit.test_queue import _group_rows


def _ids(table: pa.Table) -> list[str]:
    return sorted(set(table.column("group_id").to_pylist()))


# --- keyed commits and tombstones ---------------------------------------------------------------


def test_commit_at_a_seq_lands_once_and_readers_see_the_first(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    first, second = rows_to_table(_group_rows(1, 2, "a")), rows_to_table(_group_rows(1, 2, "b"))
    assert queue.commit("ref", 5, first, {"worker": "w1"}) is True
    assert queue.commit("ref", 5, second, {"worker": "w2"}) is False
    assert queue.read("ref", 5).equals(first)
    assert queue.record("ref", 5)["meta"] == {"worker": "w1"}


def test_tombstone_fills_a_seq_and_next_passes_over_it(tmp_path, caplog) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    queue.commit_tombstone("ref", 0, "rollout entry 0 quarantined")
    queue.commit("ref", 1, rows_to_table(_group_rows(1, 2)))
    entry = queue.entry("ref", 0)
    assert entry.table is None and "rollout entry 0 quarantined" in entry.skipped
    seq, table = queue.next("ref", -1)
    assert seq == 1 and table.num_rows == 2
    assert "ref entry 0 skipped" in caplog.text


def test_record_counts_groups_per_behaviour_version(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    rows = _group_rows(3, 2)
    for row in rows:
        row["behaviour_version_min"] = 4 if row["group_id"] == "g0" else 5
    rows[5]["behaviour_version_min"] = 3  # a group's version is its oldest row's
    queue.put("rollout", rows_to_table(rows))
    assert queue.record("rollout", 0)["versions"] == {"4": 1, "5": 1, "3": 1}


# --- quarantine ---------------------------------------------------------------------------------


def _payload_path(queue: TransferQueue, seq: int) -> tuple[str, int]:
    """The file holding entry `seq`'s Arrow bytes and where they start in it."""
    record_path = queue.store.full_path(f"log/rollout/{seq:020d}")
    record = queue.record("rollout", seq)
    if record["payload"] == "inline":
        with open(record_path, "rb") as f:
            return record_path, f.read().index(b"\n") + 1
    return queue.store.full_path(record["payload"]), 0


def _rewrite_payload(queue: TransferQueue, seq: int, new: bytes, fix_size: bool) -> None:
    path, offset = _payload_path(queue, seq)
    with open(path, "rb") as f:
        head = f.read()[:offset]
    if offset and fix_size:  # a well-formed record around a bad payload
        record = json.loads(head)
        record["bytes"] = len(new)
        head = json.dumps(record).encode() + b"\n"
    with open(path, "wb") as f:
        f.write(head + new)


def _corrupt_truncate(queue: TransferQueue, seq: int) -> None:
    path, offset = _payload_path(queue, seq)
    with open(path, "rb") as f:
        data = f.read()[offset:]
    _rewrite_payload(queue, seq, data[: len(data) // 3], fix_size=True)


def _corrupt_foreign_schema(queue: TransferQueue, seq: int) -> None:
    foreign = pa.table({"x": [1, 2, 3]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, foreign.schema) as writer:
        writer.write_table(foreign)
    _rewrite_payload(queue, seq, sink.getvalue().to_pybytes(), fix_size=True)


def _corrupt_record(queue: TransferQueue, seq: int) -> None:
    with open(queue.store.full_path(f"log/rollout/{seq:020d}"), "w") as f:
        f.write("{not json")


@pytest.mark.parametrize("inline_max_bytes", [4 << 20, 0], ids=["inline", "separate"])
@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_corrupt_truncate, "corrupt or truncated queue payload"),
        (_corrupt_foreign_schema, "missing columns"),
        (_corrupt_record, "corrupt commit record"),
    ],
)
def test_corrupt_entry_is_quarantined_with_its_reason_and_reading_goes_on(
    tmp_path, caplog, corrupt, reason, inline_max_bytes
) -> None:
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=inline_max_bytes)
    tables = [rows_to_table(_group_rows(2, 2, f"s{i}-")) for i in range(3)]
    for table in tables:
        queue.put("rollout", table)
    corrupt(queue, 1)
    with caplog.at_level(logging.ERROR):
        got = [queue.next("rollout", -1), queue.next("rollout", 0)]
    assert [seq for seq, _ in got] == [0, 2]
    assert got[1][1].equals(tables[2])
    notes = queue.quarantined("rollout")
    assert [(n["seq"], reason in n["reason"]) for n in notes] == [(1, True)]
    assert "rollout entry 1 quarantined" in caplog.text
    # The seq stays taken (a later put does not reuse it) and a second reader sees the same
    # reason even though a separate payload is gone from data/.
    assert queue.put("rollout", tables[0]) == 3
    other = TransferQueue(str(tmp_path), "run")
    entry = other.entry("rollout", 1)
    assert entry.table is None and reason in entry.skipped
    assert len(other.quarantined("rollout")) == 1


def test_quarantine_moves_a_separate_payload_aside(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    queue.put("rollout", rows_to_table(_group_rows(1, 2)))
    payload = queue.record("rollout", 0)["payload"]
    _corrupt_truncate(queue, 0)
    kept = queue.store.read_bytes(payload)
    queue.entry("rollout", 0)
    assert not queue.store.exists(payload)
    note = queue.quarantined("rollout")[0]
    assert queue.store.read_bytes(note["moved_to"]) == kept


# --- leases -------------------------------------------------------------------------------------


def _add_ref(table: pa.Table) -> pa.Table:
    return with_columns(
        table, ref_logprobs=[[-1.0] * len(r) for r in table["response_ids"].to_pylist()]
    )


def test_two_workers_split_a_stage_and_each_entry_is_output_once(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    for i in range(6):
        queue.put("rollout", rows_to_table(_group_rows(1, 2, f"p{i}-")))
    a = StageWorker(TransferQueue(str(tmp_path), "run"), "rollout", "ref", "a", lease_ttl_s=60)
    b = StageWorker(TransferQueue(str(tmp_path), "run"), "rollout", "ref", "b", lease_ttl_s=60)
    lease_a, lease_b = a.claim_next(), b.claim_next()
    assert (lease_a.seq, lease_b.seq) == (0, 1)
    assert a.complete(lease_a, _add_ref(queue.read("rollout", 0)))
    for worker in (b, a, b, a):  # interleaved; b still holds seq 1, so nobody takes it
        lease = worker.claim_next()
        assert lease.seq not in (0, 1)
        worker.complete(lease, _add_ref(queue.read("rollout", lease.seq)))
    assert a.claim_next() is None and b.pending() == [1]
    assert b.complete(lease_b, _add_ref(queue.read("rollout", 1)))
    assert queue.committed("ref") == list(range(6)) and a.pending() == []
    groups = [g for s in range(6) for g in _ids(queue.read("ref", s))]
    assert sorted(groups) == sorted(f"p{i}-g0" for i in range(6))


class Clock:
    """Seconds that pass only when the test says so: lease expiry and outage limits are decided
    by the code's clock, not by how fast a loaded machine gets from one line to the next. Kept
    in whole microseconds, and a sleep takes at least one, as a real sleep does (a float clock
    could stop short of a limit by a rounding error and never reach it)."""

    def __init__(self) -> None:
        self.micros = 10**12

    def advance(self, seconds: float) -> None:
        self.micros += max(1, math.ceil(seconds * 1e6))

    def time(self) -> float:
        return self.micros / 1e6

    monotonic = time
    sleep = advance


@pytest.fixture
def lease_clock(monkeypatch) -> Clock:
    """The clock the leases of relax_core/queue/claims.py read."""
    clock = Clock()
    monkeypatch.setattr(claims, "time", clock)
    return clock


def test_expired_lease_is_taken_over_and_the_late_worker_cannot_add_a_copy(
    tmp_path, lease_clock
) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    queue.put("rollout", rows_to_table(_group_rows(1, 2)))
    slow = StageWorker(queue, "rollout", "ref", "slow", lease_ttl_s=20)
    other = StageWorker(queue, "rollout", "ref", "other", lease_ttl_s=60)
    held = slow.claim_next()
    lease_clock.advance(19)
    assert other.claim_next() is None  # lease still valid
    lease_clock.advance(2)
    taken = other.claim_next()
    assert (taken.seq, taken.attempt, other.taken_over) == (0, 1, 1)
    table = _add_ref(queue.read("rollout", 0))
    assert other.complete(taken, table) is True
    assert slow.complete(held, table) is False  # the slow worker wakes up too late
    assert queue.record("ref", 0)["meta"]["worker"] == "other"
    assert slow.claim_next() is None


def test_a_restarted_worker_takes_its_dead_predecessors_lease_at_once(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    queue.put("rollout", rows_to_table(_group_rows(1, 2)))
    dead = StageWorker(queue, "rollout", "ref", "advantages-0", lease_ttl_s=60)
    assert dead.claim_next().seq == 0  # then its process dies
    assert StageWorker(queue, "rollout", "ref", "other", lease_ttl_s=60).claim_next() is None
    restarted = StageWorker(queue, "rollout", "ref", "advantages-0", lease_ttl_s=60)
    taken = restarted.claim_next()
    assert (taken.seq, taken.attempt, restarted.taken_over) == (0, 1, 1)
    assert restarted.claim_next() is None  # its own live lease is not taken over again


def test_renewed_lease_is_not_taken_over_and_one_left_to_expire_is(tmp_path, lease_clock) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    queue.put("rollout", rows_to_table(_group_rows(1, 2)))
    holder = StageWorker(queue, "rollout", "ref", "h", lease_ttl_s=30)
    other = StageWorker(queue, "rollout", "ref", "o", lease_ttl_s=30)
    lease = holder.claim_next()
    for _ in range(3):  # 60 s in all, twice the TTL, renewed every 20 s
        lease_clock.advance(20)
        lease = holder.renew(lease)
        assert other.claim_next() is None
    lease_clock.advance(31)  # the holder stopped renewing
    taken = other.claim_next()
    assert (taken.seq, taken.attempt, other.taken_over) == (0, 1, 1)


def test_worker_turns_a_quarantined_input_into_a_tombstone(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    queue.put("rollout", rows_to_table(_group_rows(1, 2, "a")))
    queue.put("rollout", rows_to_table(_group_rows(1, 2, "b")))
    _corrupt_truncate(queue, 0)
    worker = StageWorker(queue, "rollout", "ref", "w")
    claimed = [(lease.seq, _ids(entry.table)) for lease, entry in worker.claim()]
    # The generator yields seq 1 only; seq 0 was answered with a tombstone on the way.
    assert claimed == [(1, ["bg0"])]
    assert "quarantined" in queue.record("ref", 0)["tombstone"]
    assert worker.pending() == [1]


# --- cursor -------------------------------------------------------------------------------------


def test_stage_cursor_handles_out_of_order_and_refuses_repeats() -> None:
    cursor = StageCursor()
    for seq in (1, 3, 0):
        cursor.advance(seq)
    assert cursor.to_dict() == {"through": 1, "beyond": [3]}
    assert cursor.unconsumed([0, 1, 2, 3, 4]) == [2, 4]
    with pytest.raises(ValueError, match="seq 3 was already consumed"):
        cursor.advance(3)
    restored = StageCursor.from_dict(json.loads(json.dumps(cursor.to_dict())))
    restored.advance(2)
    assert restored.to_dict() == {"through": 3, "beyond": []}
    with pytest.raises(ValueError, match="bad stage cursor"):
        StageCursor.from_dict({"through": 2, "beyond": [1]})


# --- retries and storage errors -----------------------------------------------------------------


class _FlakyFS(MemoryFileSystem):
    """In-memory storage whose next `failures` calls fail like a dropped connection; with
    `apply_then_fail` the failing write is applied before the error (a lost reply)."""

    protocol = "memory-flaky"
    failures = 0
    apply_then_fail = False

    def _maybe_fail(self) -> None:
        if type(self).failures > 0:
            type(self).failures -= 1
            raise ConnectionResetError("connection reset by peer")

    def cat_file(self, path, *args, **kwargs):
        self._maybe_fail()
        return super().cat_file(path, *args, **kwargs)

    def pipe_file(self, path, value, *args, **kwargs):
        self._maybe_fail()
        return super().pipe_file(path, value, *args, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "x" in mode and type(self).apply_then_fail and type(self).failures > 0:
            return _LostReply(super()._open(path, mode, **kwargs), self)
        if "x" in mode:
            self._maybe_fail()
        return super()._open(path, mode, **kwargs)


class _LostReply:
    """A write handle whose close applies the write and then fails like a dropped reply."""

    def __init__(self, inner, fs: _FlakyFS) -> None:
        self.inner, self.fs = inner, fs

    def write(self, data: bytes) -> int:
        return self.inner.write(data)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.inner.close()
        self.fs._maybe_fail()


fsspec.register_implementation("memory-flaky", _FlakyFS, clobber=True)
_FAST = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.002, outage_limit_s=0)


def test_transient_errors_are_retried_and_counted() -> None:
    store = ObjectStore("memory-flaky://retry-1", retry=_FAST)
    _FlakyFS.failures = 3
    store.write_immutable("a", b"x")
    assert store.read_bytes("a") == b"x"
    assert store.retries_used == 3


def test_storage_failing_every_retry_names_the_url() -> None:
    store = ObjectStore("memory-flaky://retry-2", retry=_FAST)
    _FlakyFS.failures = 10
    with pytest.raises(StorageUnavailable, match=r"memory-flaky://retry-2/a failed 4 times"):
        store.write_immutable("a", b"x")
    _FlakyFS.failures = 0


def test_create_whose_reply_was_lost_is_recognised_as_ours() -> None:
    store = ObjectStore("memory-flaky://retry-3", retry=_FAST)
    _FlakyFS.failures, _FlakyFS.apply_then_fail = 1, True
    try:
        # The first try lands but reports a reset; the retry then sees "exists" with our bytes.
        assert store.create_if_absent("log/x", b"mine") is True
        assert store.retries_used == 1
        assert store.create_if_absent("log/x", b"theirs") is False
    finally:
        _FlakyFS.failures, _FlakyFS.apply_then_fail = 0, False


def test_an_outage_within_the_limit_is_waited_out_and_said_in_the_log(caplog) -> None:
    # 2 quick tries, then tries every 10 ms: 9 failures are an outage of ~80 ms, within 30 s.
    retry = RetryPolicy(attempts=2, base_delay_s=0.001, outage_limit_s=30, outage_poll_s=0.01)
    store = ObjectStore("memory-flaky://outage-1", retry=retry)
    _FlakyFS.failures = 9
    with caplog.at_level(logging.WARNING, logger="relax_core.queue.store"):
        store.write_immutable("a", b"x")
    assert store.read_bytes("a") == b"x"
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "is unreachable" in m]) == 1, said
    assert "waiting up to 30 s for it (storage.outage_limit_s)" in said[0]
    assert "memory-flaky://outage-1" in said[0] and "ConnectionResetError" in said[0]
    assert "answers again" in said[-1]


def test_an_outage_past_the_limit_stops_with_the_limit_named(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(object_store, "time", clock)  # a poll's sleep takes what it asks for
    retry = RetryPolicy(attempts=2, base_delay_s=0.001, outage_limit_s=0.1, outage_poll_s=0.01)
    flaky = ObjectStore("memory-flaky://outage-2", retry=retry)
    start = clock.time()
    _FlakyFS.failures = 10_000
    try:
        with pytest.raises(
            StorageUnavailable,
            match=r"memory-flaky://outage-2/a unreachable for 0.1 s, past "
            r"storage.outage_limit_s = 0.1 s, writing",
        ):
            flaky.write_immutable("a", b"x")
        # It kept trying every outage_poll_s until the limit: 1 quick retry, then 0.1 / 0.01 = 10
        # polls, the last cut to what was left of the limit (one more of a microsecond where
        # the float subtraction lands a hair short of it).
        assert flaky.retries_used in (11, 12), flaky.retries_used
        assert 0.1 <= clock.time() - start < 0.1 + 0.01
    finally:
        _FlakyFS.failures = 0


def test_the_process_outage_limit_applies_where_no_policy_names_one() -> None:
    set_outage_limit(0)
    try:
        store = ObjectStore("memory-flaky://outage-3", retry=RetryPolicy(base_delay_s=0.001))
        _FlakyFS.failures = 10
        with pytest.raises(StorageUnavailable, match="failed 4 times"):
            store.write_immutable("a", b"x")
    finally:
        _FlakyFS.failures = 0
        set_outage_limit(DEFAULT_OUTAGE_LIMIT_S)
    with pytest.raises(ValueError, match=">= 0"):
        set_outage_limit(-1)


class _DeniedFS(MemoryFileSystem):
    protocol = "memory-denied"

    def pipe_file(self, path, value, *args, **kwargs):
        raise PermissionError("The AWS Access Key Id you provided does not exist")


fsspec.register_implementation("memory-denied", _DeniedFS, clobber=True)


def test_denied_access_is_reported_at_probe_with_the_prefix_and_no_retry() -> None:
    queue = TransferQueue("memory-denied://bucket/prefix", "run1", retry=_FAST)
    with pytest.raises(StorageError, match=r"access denied writing memory-denied://bucket/prefix"):
        queue.probe()
    assert queue.store.retries_used == 0


def test_rows_survive_the_bus_unchanged(tmp_path) -> None:
    # One group through put -> worker -> commit -> cursor reader keeps every value.
    queue = TransferQueue(str(tmp_path), "run")
    rows = _group_rows(2, 3)
    queue.put("rollout", rows_to_table(rows))
    worker = StageWorker(queue, "rollout", "ref", "w")
    for lease, entry in worker.claim():
        worker.complete(lease, _add_ref(entry.table))
    out = table_to_rows(queue.read("ref", 0))
    assert [r["uid"] for r in out] == [r["uid"] for r in rows]
    assert all(r["ref_logprobs"] == [-1.0, -1.0] for r in out)
