"""Dynamic sampling (DAPO) in async mode, without processes: a dropped group frees its admission
slot and stops being in flight, the staleness bound holds over the groups kept, a dead worker's
unrecorded drops are recorded on its restart, and redraws are bounded."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from relax_core.queue import AdmissionLedger, TransferQueue, rows_to_table
from relax_core.roles.ready_pool import ReadyPool
from relax_core.roles.rollout_service import (
    DynamicSampling,
    _record_missing_drops,
    committed_blocks,
)


def _rows(groups: list[str], version: int, rewards: list[float] | None = None) -> list[dict]:
    rewards = rewards or [0.0, 1.0]
    return [
        {
            "uid": f"{g}-s{i}",
            "group_id": g,
            "behaviour_version_min": version,
            "behaviour_version_max": version,
            "reward": reward,
        }
        for g in groups
        for i, reward in enumerate(rewards)
    ]


def _pool(queue: TransferQueue) -> ReadyPool:
    return ReadyPool(SimpleNamespace(queue=queue), {"through": -1, "beyond": []})


def test_a_dropped_group_frees_its_slot_and_is_not_waited_for(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    ledger = AdmissionLedger(queue)
    # k = 0, G = 4: four groups may start under version 0.
    assert ledger.try_admit(4, 0, 0, 4, worker="w") == (0, 4)
    assert ledger.try_admit(1, 0, 0, 4, worker="w") == (4, 0)
    queue.put("ready", rows_to_table(_rows(["a", "b"], 0)))  # c and d had equal rewards
    pool = _pool(queue)
    pool.refresh()
    assert pool.in_flight_versions() == [0]
    assert ledger.record_dropped(0, ["c", "d"], 0, "w")
    assert not ledger.record_dropped(0, ["c", "d"], 0, "w")  # recorded once
    assert pool.in_flight_versions() == []  # the trainer no longer waits for c and d
    assert ledger.voided_groups() == 2 and list(ledger.dropped()) == [0]
    assert ledger.dropped()[0]["groups"] == ["c", "d"]
    # Their slots take two fresh prompts, and no more: the bound counts the groups kept.
    assert ledger.try_admit(4, 0, 0, 4, worker="w") == (4, 2)
    assert ledger.try_admit(1, 0, 0, 4, worker="w") == (6, 0)
    assert pool.in_flight_versions() == [0]
    queue.put("ready", rows_to_table(_rows(["e", "f"], 0)))
    pool.refresh()
    assert pool.in_flight_versions() == []
    assert pool.select(4, False) == ["a", "b", "e", "f"]
    # A block whose groups were all dropped reached no stage, yet is done: not regenerated.
    assert ledger.try_admit(2, 1, 0, 4, worker="w") == (6, 2)
    ledger.record_dropped(6, ["g", "h"], 1, "w")
    assert ledger.reclaim("w", committed={0, 4}) == []


def test_no_kept_group_is_trained_more_than_k_versions_late_with_drops(tmp_path):
    k, g = 1, 3
    queue = TransferQueue(str(tmp_path), "run")
    ledger, pool, rng = AdmissionLedger(queue), _pool(queue), random.Random(0)
    version, pending, staleness, dropped = 0, [], [], 0
    while version < 12:
        first, count = ledger.try_admit(2, version, k, g, worker="w")
        if count:
            pending.append((first, count, version))
            continue
        # At the bound: finish a random block; each of its groups is dropped with p = 0.5.
        first, count, behaviour = pending.pop(rng.randrange(len(pending)))
        ids = [f"t{first + i}" for i in range(count)]
        kept = [x for x in ids if rng.random() < 0.5]
        if kept:
            queue.put("rollout", rows_to_table(_rows(kept, behaviour)), {"tickets": [first, count]})
            queue.put("ready", rows_to_table(_rows(kept, behaviour)))
        ledger.record_dropped(first, [x for x in ids if x not in kept], behaviour, "w")
        dropped += count - len(kept)
        pool.refresh()
        chosen = pool.select(g, False)
        if chosen is not None:  # a trainer step at `version`
            batch = pool.take(chosen)
            staleness += [version - b for b in batch.column("behaviour_version_min").to_pylist()]
            version += 1
    assert dropped > 10 and staleness and max(staleness) <= k
    assert max(staleness) == k  # rollout did run ahead


def test_a_restarted_worker_records_the_drops_its_dead_process_committed_but_not_recorded(
    tmp_path,
):
    queue = TransferQueue(str(tmp_path), "run")
    ledger = AdmissionLedger(queue)
    assert ledger.try_admit(3, 0, 1, 4, worker="w") == (0, 3)
    meta = {"tickets": [0, 3], "worker": "w", "dropped": ["c"]}
    queue.put("rollout", rows_to_table(_rows(["a", "b"], 0)), meta)
    # The process died here, before `record_dropped`: c looks in flight.
    committed = committed_blocks(queue)
    assert list(committed) == [0]
    assert ledger.reclaim("w", set(committed)) == []
    _record_missing_drops(ledger, "w", committed)
    assert ledger.dropped()[0]["groups"] == ["c"] and ledger.dropped()[0]["policy_version"] == 0
    _record_missing_drops(ledger, "w", committed)  # a second restart changes nothing
    assert ledger.voided_groups() == 1


def test_dynamic_sampling_keeps_differing_groups_carries_metrics_and_bounds_redraws():
    sampler = DynamicSampling(groups_per_step=2, max_sampling_rounds=2)
    flat = _rows(["x", "y"], 0, [1.0, 1.0])
    rows, dropped, _ = sampler.split(flat, {"perf/generate_s": 1.0, "train/accuracy": 1.0})
    assert rows == [] and dropped == ["x", "y"]
    sampler.check()  # 2 in a row: under the limit of 2 x 2
    mixed = _rows(["a"], 0) + _rows(["b"], 0, [0.0, 0.0])
    rows, dropped, metrics = sampler.split(mixed, {"perf/generate_s": 2.0})
    assert {r["group_id"] for r in rows} == {"a"} and dropped == ["b"]
    assert metrics["rollout/filtered_groups"] == 3.0  # b, and x and y carried over
    assert metrics["rollout/sampling_rounds"] == 2.0
    assert metrics["perf/generate_s"] == 3.0  # generation time of both draws
    rows, _, metrics = sampler.split(_rows(["c"], 0), {"perf/generate_s": 1.0})
    assert metrics["rollout/filtered_groups"] == 0.0 and metrics["perf/generate_s"] == 1.0
    for _ in range(2):
        sampler.split(flat, {})
    with pytest.raises(RuntimeError, match=r"rollout\.max_sampling_rounds 2 x"):
        sampler.check()


def test_an_async_agent_run_whose_episodes_all_fail_names_the_agent_error():
    # Failed agent episodes score 0 alike, so dynamic sampling drops every group before the
    # trainer could count them: the redraw bound's error must say why.
    sampler = DynamicSampling(groups_per_step=1, max_sampling_rounds=2)
    failed = _rows(["x"], 0, [0.0, 0.0])
    for row in failed:
        row["reward_info"] = {"end_reason": "agent_error", "agent_error": "BadRequestError: 400"}
    for _ in range(2):
        sampler.split(failed, {})
    with pytest.raises(
        RuntimeError,
        match="every agent episode of the last draw failed, first: BadRequestError: 400",
    ):
        sampler.check()
    sampler.split(_rows(["a"], 0), {})  # a kept group forgets it
    assert sampler.agent_error is None
