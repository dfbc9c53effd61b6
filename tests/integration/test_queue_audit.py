"""Exactly-once audit: 4 producer and 2 consumer processes share one queue, all starting at
once, one consumer is killed while it holds a lease, and every group is consumed exactly once;
on local disk, on moto and on SeaweedFS."""

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

PRODUCERS, ENTRIES, GROUPS = 4, 15, 10  # 4 x 15 entries x 10 groups = 600 groups
HANG_AFTER = 6
"""The consumer that is killed stops making progress at this lease, holding it."""


def _spawn(role: str, root: str, run: str, record: str, options: dict, *extra: str):
    env = dict(os.environ, RELAX_TEST_STORAGE_OPTIONS=json.dumps(options))
    cmd = [sys.executable, "-m", "tests.integration.queue_actors", role]
    cmd += ["--root", root, "--run", run, "--record", record, *extra]
    cmd += ["--go", os.path.join(os.path.dirname(record), "go")]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)


def _go(procs, records: list[str], timeout: float) -> None:
    """Once every actor is up (its `{record}.ready`), let them all start at once."""
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(f"{r}.ready") for r in records):
        for p in procs:
            assert p.poll() is None, p.stderr.read()
        assert time.monotonic() < deadline, "the actors did not start"
        time.sleep(0.05)
    with open(os.path.join(os.path.dirname(records[0]), "go"), "w"):
        pass


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
    record = {name: str(tmp_path / f"{name}.jsonl") for name in ("c0", "c1")}
    record.update({f"p{i}": str(tmp_path / f"p{i}.jsonl") for i in range(PRODUCERS)})
    producers = [
        _spawn(
            "produce",
            root,
            run,
            record[f"p{i}"],
            options,
            *("--index", str(i), "--entries", str(ENTRIES), "--groups", str(GROUPS)),
        )
        for i in range(PRODUCERS)
    ]
    steady = _spawn("consume", root, run, record["c0"], options, "--worker", "c0")
    doomed = _spawn(
        "consume",
        root,
        run,
        record["c1"],
        options,
        *("--worker", "c1", "--hang-after", str(HANG_AFTER)),
    )
    _go([*producers, steady, doomed], list(record.values()), 300)
    deadline = time.monotonic() + 300
    while not any("hanging_on" in r for r in _lines(record["c1"])):
        assert doomed.poll() is None, doomed.stderr.read()
        assert time.monotonic() < deadline, f"consumer c1 never reached lease {HANG_AFTER}"
        time.sleep(0.1)
    os.kill(doomed.pid, signal.SIGKILL)  # mid-way, holding a lease
    doomed.wait()
    _wait(producers, 300)
    TransferQueue(root, run, options).stop()
    _wait([steady], 300)

    queue = TransferQueue(root, run, options)
    put = [r for i in range(PRODUCERS) for r in _lines(record[f"p{i}"])]
    seqs = sorted(r["seq"] for r in put)
    n = PRODUCERS * ENTRIES
    assert seqs == list(range(n)), "producers' seqs must be distinct and gap-free"
    assert queue.committed("rollout") == seqs
    assert queue.committed("ref") == seqs, "every rollout entry has exactly one output"

    produced = sorted(g for r in put for g in r["groups"])
    consumed = sorted(
        g for s in seqs for g in queue.read("ref", s).column("group_id").unique().to_pylist()
    )
    assert len(produced) == PRODUCERS * ENTRIES * GROUPS == 600
    assert consumed == produced, "each produced group is in the output exactly once"
    for s in seqs[:: max(1, n // 20)]:  # the output is this entry's rows, not another's
        assert queue.read("ref", s).column("group_id").unique().to_pylist() == next(
            r["groups"] for r in put if r["seq"] == s
        )

    c0, c1 = _lines(record["c0"]), _lines(record["c1"])
    hang = next(r for r in c0 + c1 if "hanging_on" in r)
    wins = [r["seq"] for r in c0 + c1 if r.get("committed")]
    assert sorted(wins) == seqs, "consumer records: one winning commit per entry"
    # The killed consumer did real work before it hung. A lease it held past its time (a
    # loaded machine) was taken over: the other consumer won that entry at a later attempt.
    done_by_c1 = [r for r in c1 if "committed" in r]
    assert len(done_by_c1) == HANG_AFTER - 1 and any(r["committed"] for r in done_by_c1)
    for lost in (r for r in done_by_c1 if not r["committed"]):
        won = next(r for r in c0 if r.get("seq") == lost["seq"] and r["committed"])
        assert won["attempt"] > lost["attempt"], (lost, won)
    taken = next(r for r in c0 if r.get("seq") == hang["hanging_on"])
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
