"""Exactly-once audit: 4 producer and 2 consumer processes share one queue, one consumer is
killed while it holds a lease, and every group is consumed exactly once; on local disk, on moto
and on SeaweedFS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from relax_core.queue import TransferQueue
from tests.conftest import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PRODUCERS, ENTRIES, GROUPS = 4, 50, 10  # 4 x 50 entries x 10 groups = 2,000 groups


def _spawn(role: str, root: str, run: str, record: str, options: dict, *extra: str):
    env = dict(os.environ, RELAX_TEST_STORAGE_OPTIONS=json.dumps(options))
    cmd = [sys.executable, "-m", "tests.integration.queue_actors", role]
    cmd += ["--root", root, "--run", run, "--record", record, *extra]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def _lines(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait(procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, p.stderr.read()


def _audit(root: str, options: dict, tmp_path) -> None:
    run = "audit"
    producers = [
        _spawn(
            "produce",
            root,
            run,
            str(tmp_path / f"p{i}.jsonl"),
            options,
            "--index",
            str(i),
            "--entries",
            str(ENTRIES),
            "--groups",
            str(GROUPS),
        )
        for i in range(PRODUCERS)
    ]
    steady = _spawn("consume", root, run, str(tmp_path / "c0.jsonl"), options, "--worker", "c0")
    doomed = _spawn(
        "consume",
        root,
        run,
        str(tmp_path / "c1.jsonl"),
        options,
        "--worker",
        "c1",
        "--hang-after",
        "15",
    )
    deadline = time.monotonic() + 300
    while not any("hanging_on" in r for r in _lines(str(tmp_path / "c1.jsonl"))):
        assert doomed.poll() is None, doomed.stderr.read()
        assert time.monotonic() < deadline, "consumer c1 never reached its 15th lease"
        time.sleep(0.1)
    os.kill(doomed.pid, signal.SIGKILL)  # mid-way, holding a lease
    doomed.wait()
    _wait(producers, 300)
    TransferQueue(root, run, options).stop()
    _wait([steady], 300)

    queue = TransferQueue(root, run, options)
    put = [r for i in range(PRODUCERS) for r in _lines(str(tmp_path / f"p{i}.jsonl"))]
    seqs = sorted(r["seq"] for r in put)
    n = PRODUCERS * ENTRIES
    assert seqs == list(range(n)), "producers' seqs must be distinct and gap-free"
    assert queue.committed("rollout") == seqs
    assert queue.committed("ref") == seqs, "every rollout entry has exactly one output"

    produced = sorted(g for r in put for g in r["groups"])
    consumed = sorted(
        g for s in seqs for g in queue.read("ref", s).column("group_id").unique().to_pylist()
    )
    assert len(produced) == PRODUCERS * ENTRIES * GROUPS == 2000
    assert consumed == produced, "each produced group is in the output exactly once"
    for s in seqs[:: max(1, n // 20)]:  # the output is this entry's rows, not another's
        assert queue.read("ref", s).column("group_id").unique().to_pylist() == next(
            r["groups"] for r in put if r["seq"] == s
        )

    records = _lines(str(tmp_path / "c0.jsonl")) + _lines(str(tmp_path / "c1.jsonl"))
    hang = next(r for r in records if "hanging_on" in r)
    wins = [r["seq"] for r in records if r.get("committed")]
    assert sorted(wins) == seqs, "consumer records: one winning commit per entry"
    by_c1 = [r["seq"] for r in _lines(str(tmp_path / "c1.jsonl")) if r.get("committed")]
    assert len(by_c1) == 14, "the killed consumer did real work before it hung"
    taken = next(
        r for r in _lines(str(tmp_path / "c0.jsonl")) if r.get("seq") == hang["hanging_on"]
    )
    assert taken["committed"] and taken["attempt"] == hang["attempt"] + 1
    assert queue.record("ref", hang["hanging_on"])["meta"]["worker"] == "c0"


def test_exactly_once_on_local_disk(tmp_path) -> None:
    _audit(str(tmp_path / "queue"), {}, tmp_path)


def test_exactly_once_on_moto(moto_s3, tmp_path) -> None:
    _audit(f"s3://{moto_s3.bucket}/audit-{tmp_path.name}", moto_s3.storage_options(), tmp_path)


def test_exactly_once_on_seaweedfs(seaweed_s3, tmp_path) -> None:
    _audit(
        f"s3://{seaweed_s3.bucket}/audit-{tmp_path.name}", seaweed_s3.storage_options(), tmp_path
    )
