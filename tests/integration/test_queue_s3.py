"""TransferQueue against a real S3 API (moto server on loopback): conditional commits are enforced."""

from __future__ import annotations

import logging

import pytest

from relax_core.queue import TransferQueue, rows_to_table
from tests.unit.test_queue import _group_rows

pytestmark = pytest.mark.integration


@pytest.fixture
def s3_options():
    server_module = pytest.importorskip("moto.server")
    s3fs = pytest.importorskip("s3fs")
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "eu-west-1"},
    }
    s3fs.S3FileSystem(**options).mkdir("queue-bucket")
    try:
        yield options
    finally:
        server.stop()


def test_s3_put_read_and_racing_writers(s3_options) -> None:
    root = "s3://queue-bucket/runs"
    a, b = TransferQueue(root, "r1", s3_options), TransferQueue(root, "r1", s3_options)
    table = rows_to_table(_group_rows(2, 2))
    # Each writer's cached seq is stale after the other's put: the server must refuse it.
    assert [a.put("rollout", table), b.put("rollout", table), a.put("rollout", table)] == [0, 1, 2]
    assert b.put("rollout", table) == 3
    assert b.committed("rollout") == [0, 1, 2, 3]
    payloads = {a.record("rollout", s)["payload"] for s in range(4)}
    assert len(payloads) == 4
    seq, got = b.next("rollout", 2)
    assert seq == 3 and got.equals(table)
    assert a.store.create_if_absent("log/rollout/00000000000000000003", b"{}") is False
    a.stop()
    assert b.stopped()
