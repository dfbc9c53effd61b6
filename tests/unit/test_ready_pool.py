"""The async trainer's view of `ready`: step batches oldest first, never ahead of a group still
in flight, and a saved position that resumes without repeating or skipping a group."""

from __future__ import annotations

from types import SimpleNamespace

from relax_core.queue import AdmissionLedger, TransferQueue, rows_to_table
from relax_core.roles.ready_pool import ReadyPool


def _put(queue: TransferQueue, groups: list[str], version: int) -> int:
    rows = [
        {
            "uid": f"{g}-{i}",
            "group_id": g,
            "behaviour_version_min": version,
            "behaviour_version_max": version,
        }
        for g in groups
        for i in range(2)
    ]
    return queue.put("ready", rows_to_table(rows))


def _pool(queue: TransferQueue, cursor: dict | None = None) -> ReadyPool:
    return ReadyPool(SimpleNamespace(queue=queue), cursor or {"through": -1, "beyond": []})


def _groups(table) -> list[str]:
    return sorted(set(table.column("group_id").to_pylist()))


def test_a_split_entry_resumes_with_only_its_untrained_groups(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    AdmissionLedger(queue).try_admit(6, 0, 1, 3)
    _put(queue, ["a", "b", "c"], 0)
    _put(queue, ["d", "e", "f"], 0)
    pool = _pool(queue)
    pool.refresh()
    assert _groups(pool.take(pool.select(2, False))) == ["a", "b"]
    saved = pool.state()
    assert saved == {"through": -1, "beyond": [], "partial": {"0": ["a", "b"]}}

    resumed = _pool(queue, saved)  # what a restarted trainer builds from its checkpoint
    resumed.refresh()
    assert sorted(resumed.groups) == ["c", "d", "e", "f"]
    assert _groups(resumed.take(resumed.select(2, False))) == ["c", "d"]
    assert resumed.state() == {"through": 0, "beyond": [], "partial": {"1": ["d"]}}
    assert _groups(resumed.take(resumed.select(2, False))) == ["e", "f"]
    assert resumed.state() == {"through": 1, "beyond": [], "partial": {}}


def test_no_group_jumps_ahead_of_an_older_one_still_generating(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    ledger = AdmissionLedger(queue)
    ledger.try_admit(4, 0, 1, 2)  # 4 groups admitted under version 0 ...
    _put(queue, ["a", "b"], 0)  # ... only 2 of them are ready
    ledger.try_admit(2, 1, 1, 2)
    _put(queue, ["x", "y"], 1)
    pool = _pool(queue)
    pool.refresh()
    assert pool.in_flight_versions() == [0]
    assert pool.select(3, False) is None  # x, y (version 1) wait for the version-0 stragglers
    assert pool.select(3, True) is not None  # unless the trainer gave up waiting on them
    _put(queue, ["c", "d"], 0)
    pool.refresh()
    assert pool.in_flight_versions() == []
    assert pool.select(4, False) == ["a", "b", "c", "d"]


def test_a_resumed_pool_counts_entries_trained_before_the_checkpoint_as_arrived(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    ledger = AdmissionLedger(queue)
    ledger.try_admit(2, 0, 1, 2)
    _put(queue, ["a", "b"], 0)
    ledger.try_admit(2, 1, 1, 2)
    _put(queue, ["c", "d"], 1)
    pool = _pool(queue)
    pool.refresh()
    pool.take(pool.select(2, False))
    resumed = _pool(queue, pool.state())  # entry 0 trained before the checkpoint
    for _ in range(3):  # every poll: version 0 is not in flight, and is never counted twice
        resumed.refresh()
        assert resumed.in_flight_versions() == []
    assert resumed.select(2, False) == ["c", "d"]


def test_groups_a_server_generated_after_an_update_arrive_under_their_admission(tmp_path):
    """A vLLM server holds requests that arrive during a weight update's pause and runs them on
    the new weights: a block admitted under version 0 arrives stamped 1. It is no longer in
    flight (else every newer group waits a lease TTL for it), and it trains as version 1."""
    queue = TransferQueue(str(tmp_path), "run")
    ledger = AdmissionLedger(queue)
    ledger.try_admit(2, 0, 1, 2)
    rows = [
        {"uid": f"{g}-0", "group_id": g, "behaviour_version_min": 1, "behaviour_version_max": 1}
        for g in ("a", "b")
    ]
    queue.put("ready", rows_to_table(rows), {"admitted_version": 0, "tickets": [0, 2]})
    ledger.try_admit(2, 1, 1, 2)
    _put(queue, ["c", "d"], 1)
    pool = _pool(queue)
    pool.refresh()
    assert pool.in_flight_versions() == []
    assert pool.select(4, False) == ["a", "b", "c", "d"]
    assert pool.groups["a"][0] == 1  # its behaviour version, the weights that sampled it
