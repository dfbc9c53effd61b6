"""`relax queue`: what a person watching a run sees about its queue."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from relax_core.entrypoints.cli import main as relax
from relax_core.queue import StageWorker, TransferQueue, rows_to_table
from tests.needs import missing
from tests.unit.test_queue import _group_rows


def _run_queue(root: str) -> TransferQueue:
    queue = TransferQueue(root, "run-a", inline_max_bytes=0)
    for i in range(5):
        rows = _group_rows(3, 2, f"p{i}-")
        for row in rows:
            row["behaviour_version_min"] = i // 2
        queue.put("rollout", rows_to_table(rows), {"policy_version": i // 2})
    worker = StageWorker(queue, "rollout", "ready", "w0")
    for n, (lease, entry) in enumerate(worker.claim()):
        meta = {"policy_version": 2}
        worker.complete(lease, entry.table, meta)
        if n == 2:
            break
    queue.heartbeat("trainer", "0", {"policy_version": 2})
    return queue


def test_summary_shows_backlog_staleness_quarantine_and_heartbeats(tmp_path, capsys) -> None:
    queue = _run_queue(str(tmp_path))
    with open(queue.store.full_path(queue.record("rollout", 4)["payload"]), "wb") as f:
        f.write(b"not arrow")
    queue.entry("rollout", 4)
    assert relax(["queue", str(tmp_path), "--run", "run-a"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rollout = next(line for line in lines if line.startswith("rollout "))
    # 5 entries, 15 groups, 30 rows, 2 not yet consumed by `ready`, 1 quarantined.
    assert rollout.split() == ["rollout", "5", "15", "30", "2", "ready", "0", "1"]
    assert "rollout 3 claimed (0 taken over)" in out
    assert "rollout 4: corrupt or truncated queue payload" in out
    # ready holds seqs 0-2: groups of versions 0, 0, 1 -> 6 at v0, 3 at v1; committed at v2,
    # so staleness 2 for 6 groups and 1 for 3.
    hist = out[out.index("'ready' groups by") :]
    assert "0  " in hist and " 6" in hist and " 3" in hist
    assert "staleness of 'ready' groups when committed" in out
    assert "trainer-0" in out and "{'policy_version': 2}" in out


def test_json_summary_and_run_listing(tmp_path, capsys) -> None:
    _run_queue(str(tmp_path))
    # A run starting in the same root checks its access with a probe file there meanwhile.
    (tmp_path / ".relax-probe-0123").write_bytes(b"probe")
    assert relax(["queue", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == ["run-a"]
    assert TransferQueue(str(tmp_path), ".relax-probe-0123").heartbeats() == []
    assert relax(["queue", str(tmp_path), "--run", "run-a", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    ready = summary["stages"]["ready"]
    assert (ready["entries"], ready["groups"]) == (3, 9)
    assert ready["lag_at_commit"] == {"1": 3, "2": 6}
    assert summary["policy_version"] == 2 and summary["stopped"] is False


def test_missing_run_is_an_error_naming_it(tmp_path, capsys) -> None:
    _run_queue(str(tmp_path))
    assert relax(["queue", str(tmp_path), "--run", "nope"]) == 1
    assert "no queue entries for run 'nope'" in capsys.readouterr().err


def _installed_relax() -> str:
    """The `relax` console script `pip install -e .` put beside this interpreter (or on PATH)."""
    found = shutil.which("relax", path=os.path.dirname(sys.executable)) or shutil.which("relax")
    if found is None:
        missing("the `relax` console script is not installed", "pip install -e .")
    return found


def test_the_installed_relax_script_shows_the_run(tmp_path) -> None:
    _run_queue(str(tmp_path))
    shown = subprocess.run(
        [_installed_relax(), "queue", str(tmp_path), "--run", "run-a"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("run run-a")
    rollout = next(line for line in shown.stdout.splitlines() if line.startswith("rollout "))
    assert rollout.split() == ["rollout", "5", "15", "30", "2", "ready", "0", "0"]
    assert "trainer-0" in shown.stdout and "{'policy_version': 2}" in shown.stdout
