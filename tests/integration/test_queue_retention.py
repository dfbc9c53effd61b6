"""Queue retention against real S3 APIs (moto and SeaweedFS on loopback): a run-shaped queue
stays bounded when pruned and grows when kept, the audit accounts for what was deleted, and
readers in other clients racing the deletions (a second advantages worker, a `relax queue`
watcher reading every entry) lose and quarantine nothing."""

from __future__ import annotations

import threading
import time

import pytest

from relax_core.queue import STAGES, StageWorker, TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.queue.inspect import summarize
from tests.s3servers import S3Server
from tests.unit.test_queue_pruning import RunShape

pytestmark = pytest.mark.integration

ENTRY_PREFIXES = ("log", "data", "claims")
"""Where a run's entries live (each step adds objects here); the rest is small metadata."""
STEPS = 10
"""Steps of the bounded run: 4 pruning passes after the window is full (step 3)."""
ROUNDS = 8
"""Steps of the race: a pruning pass after each, deleting what a reader is reading."""


@pytest.fixture(params=["moto_s3", "seaweed_s3"], ids=["moto", "seaweedfs"])
def server(request) -> S3Server:
    return request.getfixturevalue(request.param)


def _queue(server: S3Server, run: str) -> TransferQueue:
    # Its own client (no shared listing cache), as another process would have; payloads of
    # every size in their own objects, so deleting them is exercised too.
    options = {**server.storage_options(), "skip_instance_cache": True}
    return TransferQueue(f"s3://{server.bucket}/retention", run, options, inline_max_bytes=0)


def _count(queue: TransferQueue, prefixes=ENTRY_PREFIXES) -> int:
    fs = queue.store.fs
    fs.invalidate_cache()
    return sum(len(fs.find(queue.store.full_path(prefix))) for prefix in prefixes)


@pytest.mark.slow
def test_a_pruned_queue_stays_bounded_and_a_kept_one_grows(server):
    run_id = f"bounded-{time.time_ns()}"
    pruned = _queue(server, f"{run_id}-prune")
    kept = _queue(server, f"{run_id}-keep")
    shapes = {"prune": RunShape(pruned), "keep": RunShape(kept, retention="keep")}
    counts: dict[str, list[int]] = {"prune": [], "keep": []}
    for _ in range(STEPS):
        for name, shape in shapes.items():
            shape.step()
            counts[name].append(_count(shape.queue))
    # 5 entry objects per step (2 records, 2 payloads, a claim). Pruned after each checkpoint
    # (every 2 steps, 2 kept): 3 steps at most, from step 3 on. Kept: all of them.
    assert counts["prune"][:3] == [5, 10, 15] and max(counts["prune"]) == 15
    assert counts["prune"][-4:] == [15, 10, 15, 10]
    assert counts["keep"] == [5 * (step + 1) for step in range(STEPS)]
    # Deleted: every entry but the last 2 steps' (2 groups each).
    audit = audit_run(pruned, shapes["prune"].state(STEPS))
    assert audit["lost_groups"] == audit["duplicated_groups"] == 0, audit
    assert audit["generated_groups"] == audit["trained_groups"] == 2 * STEPS
    assert audit["pruned_entries"] == STEPS - 2 and audit["pruned_groups"] == 2 * (STEPS - 2)
    assert audit_run(kept, shapes["keep"].state(STEPS))["pruned_groups"] == 0
    stages = summarize(pruned)["stages"]
    assert stages["rollout"]["pruned"]["entries"] == stages["ready"]["pruned"]["entries"]
    assert stages["rollout"]["pruned"]["entries"] == STEPS - 2


@pytest.mark.slow
def test_readers_racing_deletions_lose_and_quarantine_nothing(server):
    run_id = f"race-{time.time_ns()}"
    run = RunShape(_queue(server, run_id), every=1, keep=1, keep_versions=0)
    stop, failures, reads = threading.Event(), [], {"entries": 0, "gone": 0}
    reading = threading.Event()  # the reader is reading an entry's payload

    def watch() -> None:
        """Read the oldest entries, the next a pass deletes, over and over until they are gone
        (as a person or a tool reading a live run's queue might), and `relax queue`. Payloads
        take a while to arrive, as large ones do, so passes delete entries mid-read."""
        queue = _queue(server, run_id)
        read_bytes = queue.store.read_bytes

        def slow_payloads(path: str) -> bytes:
            if path.startswith("data/"):
                reading.set()
                time.sleep(0.02)
            return read_bytes(path)

        queue.store.read_bytes = slow_payloads
        while not stop.is_set():
            try:
                summarize(queue)
                for stage in ("rollout", "ready"):
                    for seq in queue.committed(stage)[:1]:
                        while not stop.is_set():
                            queue.entry(stage, seq)
                            reads["entries"] += 1
            except FileNotFoundError:  # deleted since the listing, record or payload
                reads["gone"] += 1
            except Exception as err:  # noqa: BLE001 - reported by the test below
                failures.append(repr(err))
                return

    def compete() -> None:
        """A second advantages worker, taking whatever entry it can."""
        queue = _queue(server, run_id)
        worker = StageWorker(queue, "rollout", "ready", "advantages-1")
        while not stop.is_set():
            try:
                for lease, entry in worker.claim():
                    worker.complete(lease, entry.table, meta=entry.record.get("meta"))
            except Exception as err:  # noqa: BLE001 - reported by the test below
                failures.append(repr(err))
                return
            time.sleep(0.005)

    threads = [threading.Thread(target=watch), threading.Thread(target=compete)]
    for t in threads:
        t.start()
    try:
        for _ in range(ROUNDS):
            run.generate()
            run.transform()
            # The reader is back at the oldest entry, which the pass below deletes under it.
            reading.clear()
            assert reading.wait(120), f"the reader stopped reading: {failures}"
            run.train()  # a checkpoint every step: a pass deletes the step before
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert failures == []
    # Each pass but the first deleted what the reader was reading (the last may end it first).
    assert reads["gone"] >= ROUNDS - 2 and reads["entries"] >= 10, reads
    queue = run.queue
    assert all(queue.quarantined(stage) == [] for stage in STAGES)
    audit = audit_run(queue, run.state(ROUNDS))
    assert audit["lost_groups"] == audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == audit["generated_groups"] == 2 * ROUNDS  # 2 groups a step
    # A pass after every step but the first, each deleting the step before.
    assert audit["trained_but_never_generated"] == 0 and audit["pruned_entries"] == ROUNDS - 1
