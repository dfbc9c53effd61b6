"""Staleness admission: the pure rules, the storage ledger, and the bound they give together."""

from __future__ import annotations

import heapq
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_core.queue import (
    AdmissionLedger,
    TransferQueue,
    admissible,
    admission_limit,
    may_start_group,
    rows_to_table,
    select_step_groups,
    split_over_stale,
    staleness_histogram,
)


def test_admission_limit_formula() -> None:
    # (v + k + 1) * G: at v=3, k=2, G=4 -> (3 + 2 + 1) * 4 = 24 groups may have started.
    assert admission_limit(3, 2, 4) == 24
    assert may_start_group(23, 3, 2, 4) and not may_start_group(24, 3, 2, 4)
    # On-policy (k=0): only the current step's groups, (v + 1) * G.
    assert admission_limit(0, 0, 8) == 8 and admissible(5, 0, 0, 8) == 3
    assert admissible(30, 3, 2, 4) == 0
    with pytest.raises(ValueError, match="max_staleness must be >= 0"):
        admission_limit(0, -1, 4)
    with pytest.raises(ValueError, match="groups_per_step must be >= 1"):
        admission_limit(0, 0, 0)


def test_select_takes_oldest_first_and_waits_behind_an_older_group_in_flight() -> None:
    available = [("c", 2), ("a", 0), ("b", 1), ("d", 2)]
    assert select_step_groups(available, [], 2) == ["a", "b"]
    # A version-1 group is still generating: version-2 groups must not jump ahead of it.
    assert select_step_groups(available, [1], 3) is None
    assert select_step_groups(available, [1], 2) == ["a", "b"]
    assert select_step_groups(available, [2, 5], 4) == ["a", "b", "c", "d"]


def test_staleness_histogram_and_backstop_drop_whole_groups() -> None:
    assert staleness_histogram(5, [5, 4, 4, 2]) == {0: 1, 1: 2, 3: 1}
    rows = []
    for group, versions in (("old", [1, 3]), ("ok", [3, 3]), ("new", [4, 4])):
        for i, v in enumerate(versions):
            rows.append({"uid": f"{group}{i}", "group_id": group, "behaviour_version_min": v})
    table = rows_to_table(rows)
    # Train version 5, k = 2: staleness of "old" is 5 - min(1, 3) = 4 > 2 -> dropped whole.
    kept, dropped = split_over_stale(table, 5, 2)
    assert dropped == 1 and sorted(set(kept["group_id"].to_pylist())) == ["new", "ok"]
    assert split_over_stale(table, 5, 4) == (table, 0)


def _simulate(
    durations: list[int], groups_per_step: int, k: int, workers: int, steps: int, ordered: bool
) -> list[int]:
    """Event-driven run of `workers` rollout workers and one trainer; staleness of every
    trained group. Group i takes durations[i % len] time units; a train step takes 1."""
    now, version, started, trained = 0, 0, 0, []
    in_flight: list[tuple[int, int, int]] = []  # (finish time, group index, version)
    finished: list[tuple[str, int]] = []
    idle_workers = workers
    trainer_busy_until = None
    while len(trained) < steps * groups_per_step:
        while idle_workers and may_start_group(started, version, k, groups_per_step):
            dur = durations[started % len(durations)]
            heapq.heappush(in_flight, (now + dur, started, version))
            started, idle_workers = started + 1, idle_workers - 1
        if trainer_busy_until is None:
            if ordered:
                batch = select_step_groups(finished, [v for *_, v in in_flight], groups_per_step)
            else:  # first come, first trained: what admission alone would give
                batch = [g for g, _ in finished[:groups_per_step]]
                batch = batch if len(batch) == groups_per_step else None
            if batch is not None:
                chosen = set(batch)
                trained += [version - v for g, v in finished if g in chosen]
                finished = [(g, v) for g, v in finished if g not in chosen]
                trainer_busy_until = now + 1
        events = [t for t in (trainer_busy_until,) if t is not None]
        events += [in_flight[0][0]] if in_flight else []
        assert events, "deadlock: nothing in flight and the trainer cannot fill a batch"
        now = min(events)
        if trainer_busy_until == now:
            trainer_busy_until, version = None, version + 1
        while in_flight and in_flight[0][0] == now:
            _, index, v = heapq.heappop(in_flight)
            finished.append((f"g{index}", v))
            idle_workers += 1
    return trained


@settings(max_examples=300, deadline=None)
@given(
    durations=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    groups_per_step=st.integers(1, 5),
    k=st.integers(0, 3),
    workers=st.integers(1, 12),
    steps=st.integers(1, 12),
)
def test_no_trained_group_ever_exceeds_max_staleness(
    durations, groups_per_step, k, workers, steps
) -> None:
    trained = _simulate(durations, groups_per_step, k, workers, steps, ordered=True)
    assert len(trained) == steps * groups_per_step
    assert min(trained) >= 0 and max(trained) <= k


def test_admission_alone_does_not_bound_staleness_when_groups_finish_out_of_order() -> None:
    # k=2, G=1, 3 workers; the first two groups are slow. Trained first-come-first-served, the
    # trainer moves ahead on fast groups and a slow version-0 group arrives 3+ versions late.
    durations = [50, 50, 1, 1, 1, 1, 1, 1, 1, 1]
    fcfs = _simulate(durations, 1, 2, 3, 40, ordered=False)
    assert max(fcfs) > 2
    assert max(_simulate(durations, 1, 2, 3, 40, ordered=True)) <= 2


def test_ledger_never_admits_past_the_limit_under_concurrent_workers(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    admitted: list[tuple[int, int]] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        ledger = AdmissionLedger(TransferQueue(str(tmp_path), "run"))
        for _ in range(10):
            first, count = ledger.try_admit(
                3, policy_version=1, max_staleness=1, groups_per_step=4, worker=name
            )
            if count:
                with lock:
                    admitted.append((first, count))

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Limit at v=1, k=1, G=4: (1 + 1 + 1) * 4 = 12 groups, in disjoint, gap-free ticket blocks.
    tickets = sorted(t for first, count in admitted for t in range(first, first + count))
    assert tickets == list(range(12))
    ledger = AdmissionLedger(queue)
    assert ledger.started() == 12 and ledger.started_by_version() == {1: 12}
    assert ledger.try_admit(1, 1, 1, 4) == (12, 0)
    assert ledger.try_admit(5, 2, 1, 4)[1] == 4  # the next version opens G more slots


def test_a_restarted_worker_voids_its_uncommitted_blocks_and_regenerates_their_prompts(
    tmp_path,
) -> None:
    ledger = AdmissionLedger(TransferQueue(str(tmp_path), "run"))
    # v0, k=1, G=4: 8 groups may start. w0 takes 0..2 and 3..5, w1 takes 6..7.
    assert ledger.try_admit(3, 0, 1, 4, worker="w0") == (0, 3)
    assert ledger.try_admit(3, 0, 1, 4, worker="w0") == (3, 3)
    assert ledger.try_admit(3, 0, 1, 4, worker="w1") == (6, 2)
    assert ledger.try_admit(1, 0, 1, 4, worker="w1") == (8, 0)  # at the bound
    # w0 died having committed only its first block: the second is voided, its prompts returned.
    assert ledger.reclaim("w0", committed={0}) == [(3, 3)]
    assert list(ledger.voided()) == [3]
    assert ledger.reclaim("w0", committed={0}) == []  # voided once, not again
    # The voided groups no longer count against the bound; the new block carries their prompts.
    first, count = ledger.try_admit(3, 0, 1, 4, worker="w0", stream_first=3)
    assert (first, count) == (8, 3)
    assert ledger.blocks()[8]["stream_first"] == 3
    assert ledger.try_admit(1, 0, 1, 4, worker="w0") == (11, 0)  # 8 live groups: the bound again
    # The next fresh block takes the next fresh prompts, 8..: the redo took tickets 8..10 but
    # no new stream positions, so the stream neither skips 8..10 nor repeats 3..5.
    assert ledger.try_admit(4, 1, 1, 4, worker="w1") == (11, 4)
    assert ledger.stream_first == 8
    issued = sorted(
        p
        for first, body in ledger.blocks().items()
        if first not in ledger.voided()
        for p in range(body["stream_first"], body["stream_first"] + body["count"])
    )
    assert issued == list(range(12))
