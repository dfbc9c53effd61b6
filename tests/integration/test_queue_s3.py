"""TransferQueue against real S3 APIs (moto and SeaweedFS on loopback): conditional commits hold."""

from __future__ import annotations

import time

import pytest

from relax_core.config import QueueConfig
from relax_core.queue import (
    RetryPolicy,
    StageWorker,
    StorageError,
    StorageUnavailable,
    TransferQueue,
    check_queue_storage,
    rows_to_table,
)
from tests.s3servers import S3Server
from tests.unit.test_queue import _group_rows

pytestmark = pytest.mark.integration


# Servers disagree on details the queue depends on: a refused If-None-Match is FileExistsError
# from moto but a plain OSError from SeaweedFS, so every test runs on both.
@pytest.fixture(params=["moto_s3", "seaweed_s3"], ids=["moto", "seaweedfs"])
def server(request) -> S3Server:
    return request.getfixturevalue(request.param)


@pytest.fixture
def s3_options(server) -> dict:
    return server.storage_options()


def test_s3_put_read_and_racing_writers(s3_options) -> None:
    root = "s3://queue-bucket/runs"
    # Two clients with their own listing caches, as two processes would have.
    a = TransferQueue(root, "r1", {**s3_options, "skip_instance_cache": True})
    b = TransferQueue(root, "r1", {**s3_options, "skip_instance_cache": True})
    assert a.store.fs is not b.store.fs
    assert b.committed("rollout") == []  # b lists (and s3fs would cache) an empty log
    table = rows_to_table(_group_rows(2, 2))
    # Each writer's cached seq is stale after the other's put: the server must refuse it.
    assert [a.put("rollout", table), b.put("rollout", table), a.put("rollout", table)] == [0, 1, 2]
    assert b.put("rollout", table) == 3
    assert b.committed("rollout") == [0, 1, 2, 3]
    writers = [a.record("rollout", s)["writer"] for s in range(4)]
    assert writers == [a.writer_id, b.writer_id, a.writer_id, b.writer_id]
    seq, got = b.next("rollout", 2)
    assert seq == 3 and got.equals(table)
    assert a.store.create_if_absent("log/rollout/00000000000000000003", b"{}") is False
    a.stop()
    assert b.stopped()


def test_large_entries_quarantine_and_takeover_on_s3(s3_options, server) -> None:
    root = f"s3://{server.bucket}/runs"
    queue = TransferQueue(root, f"r2-{time.time_ns()}", s3_options, inline_max_bytes=0)
    tables = [rows_to_table(_group_rows(2, 2, f"e{i}-")) for i in range(3)]
    for table in tables:
        queue.put("rollout", table)
    assert queue.record("rollout", 0)["payload"].startswith("data/rollout/")
    # A truncated payload on the server is quarantined and the reader moves on.
    payload = queue.record("rollout", 1)["payload"]
    queue.store.fs.pipe_file(queue.store.full_path(payload), b"ARROW1 truncated")
    slow = StageWorker(queue, "rollout", "ref", "slow", lease_ttl_s=0.5)
    held = slow.claim_next()
    assert held.seq == 0
    time.sleep(0.7)
    fast = StageWorker(TransferQueue(root, queue.run_id, s3_options), "rollout", "ref", "fast")
    done = []
    for lease, entry in fast.claim():
        assert fast.complete(lease, entry.table)
        done.append((lease.seq, lease.attempt))
    assert done == [(0, 1), (2, 0)]
    assert slow.complete(held, tables[0]) is False
    assert queue.committed("ref") == [0, 1, 2]
    assert "quarantined" in queue.record("ref", 1)["tombstone"]
    note = queue.quarantined("rollout")[0]
    assert note["seq"] == 1 and "corrupt or truncated" in note["reason"]
    assert not queue.store.exists(payload)


# moto accepts any credentials, so access checks run against SeaweedFS, which verifies them.
def test_wrong_credentials_name_the_bucket_and_prefix(seaweed_s3) -> None:
    server = seaweed_s3
    options = server.storage_options()
    options["secret"] = "wrong-secret"
    queue = TransferQueue(f"s3://{server.bucket}/team/runs", "r3", options)
    with pytest.raises(StorageError, match=rf"access denied .*s3://{server.bucket}/team/runs/r3"):
        queue.probe()


# SeaweedFS creates a bucket on first write, so a missing bucket is an error on moto only.
def test_missing_bucket_is_named(moto_s3) -> None:
    queue = TransferQueue("s3://no-such-bucket-here/runs", "r4", moto_s3.storage_options())
    with pytest.raises(StorageError, match="no-such-bucket-here.* does not exist"):
        queue.probe()


def test_unreachable_endpoint_is_reported_after_retries() -> None:
    options = {
        "key": "k",
        "secret": "s",
        "client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "eu-west-1"},
        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}},
    }
    retry = RetryPolicy(attempts=2, base_delay_s=0.01, outage_limit_s=0)
    queue = TransferQueue("s3://some-bucket/runs", "r5", options, retry=retry)
    with pytest.raises(StorageUnavailable, match=r"s3://some-bucket/runs/r5.* failed 2 times"):
        queue.probe()
    assert queue.store.retries_used == 1


def test_preflight_check_of_the_queue_root(seaweed_s3, monkeypatch) -> None:
    server = seaweed_s3
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret)
    monkeypatch.setenv("AWS_DEFAULT_REGION", server.region)
    good = QueueConfig(root=f"s3://{server.bucket}/pre", endpoint_url=server.endpoint_url)
    check_queue_storage(good, multi_writer=True)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(StorageError, match=rf"access denied .*s3://{server.bucket}/pre"):
        check_queue_storage(good)
