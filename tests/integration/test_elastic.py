"""Elastic rollout against a real async run: every role an OS process, weights over gloo, the
scaling API on loopback, driven through `ScaleClient` (what `relax scale` uses).

Mid-run, a wrong token and a bad target are refused and start nothing; a scale-out adds an engine
that takes work only with the trainer's current weights; a scale-in drains it; the run finishes
and the audit finds no group lost or trained twice.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from relax_core.ops.scale_client import ScaleApiError, ScaleClient
from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.rollout.sglang_engine import SGLangClient, wait_healthy
from relax_core.train.checkpoint import find_resume_checkpoint, read_state
from tests.s3servers import free_ports

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICES = {"trainer_threads": 1, "poll_s": 0.002, "heartbeat_s": 0.2}


def _wait(what: str, check, proc: subprocess.Popen, timeout: float = 300.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            pytest.fail(f"the run ended before {what}: {proc.communicate()[0]}")
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _start_run(cfg: str):
    """The run as a process, once its scaling API is up: (process, API file, queue, client)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    api_file = _wait(
        "the scaling API", lambda: glob.glob(".relax/checkpoints/*/scale_api.json"), proc
    )[0]
    run_dir = os.path.dirname(api_file)
    queue = TransferQueue(".relax/queue", os.path.basename(run_dir))
    return proc, api_file, queue, ScaleClient.for_run(run_dir)


def _trainer_version(queue: TransferQueue) -> int:
    return max(
        (b["info"].get("policy_version", 0) for b in queue.heartbeats() if b["role"] == "trainer"),
        default=0,
    )


def _entries_of(queue: TransferQueue, worker: str) -> list[dict]:
    metas = [queue.record("rollout", seq)["meta"] for seq in queue.committed("rollout")]
    return [m for m in metas if m["worker"] == worker]


def test_engines_scale_out_and_in_mid_run_and_no_group_is_lost(small_config, workdir):
    total = 900
    cfg = small_config(
        "e.yaml",
        run_name="e",
        mode="async",
        rollout={"max_staleness": 2},
        train={"total_steps": total, "checkpoint_every": 450},
        services=SERVICES,
    )
    proc, api_file, queue, client = _start_run(cfg)
    run_dir = os.path.dirname(api_file)
    _wait("step 20", lambda: _trainer_version(queue) >= 20, proc)

    # Refused requests change nothing.
    with pytest.raises(ScaleApiError) as refused:
        ScaleClient(client.url, "not-the-token").scale_out(2)
    assert refused.value.status == 401
    with pytest.raises(ScaleApiError) as refused:
        client.scale_out(0)
    assert refused.value.status == 400 and "target must be 1..8" in str(refused.value)
    pool = client.engines()
    assert [(e["name"], e["state"]) for e in pool["engines"]] == [("rollout-0", "active")]
    assert pool["operation"] is None and not os.path.exists(f"{run_dir}/logs/rollout-1.log")

    asked_at = _trainer_version(queue)
    op = client.scale_out(2)
    assert op["status"] == "running" and op["engines"] == ["rollout-1"]
    done = client.wait(op, timeout_s=240, poll_s=0.1)
    assert done["status"] == "succeeded", done
    _wait("rollout-1's groups", lambda: len(_entries_of(queue, "rollout-1")) >= 3, proc)

    op = client.scale_in(target=1)
    assert op["engines"] == ["rollout-1"]
    done = client.wait(op, timeout_s=240, poll_s=0.1)
    assert done["status"] == "succeeded", done
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert not os.path.exists(api_file)  # the API ends with the run

    state = read_state(find_resume_checkpoint(".relax/checkpoints", "e"))
    assert state["policy_version"] == total
    # The added engine generated only with the trainer's weights of its time, never with the
    # checkpoint's (step 0) it loaded at start, and committed every group it admitted.
    added = _entries_of(queue, "rollout-1")
    assert added and min(m["policy_version"] for m in added) >= asked_at
    with open(f"{run_dir}/roles.json") as f:
        roles = [r for r in json.load(f) if r["role"] == "rollout"]
    assert [(r["worker"], r["exit_code"]) for r in roles] == [(0, 0), (1, 0)]
    with open(f"{run_dir}/recovery.json") as f:
        recovery = json.load(f)
    assert [op["status"] for op in recovery["scale_operations"]] == ["succeeded", "succeeded"]
    assert recovery["events"] == []  # nothing failed on the way
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == total * 4


def test_an_sglang_server_registered_by_url_takes_work_with_the_trainers_weights(
    small_config, workdir
):
    """External mode: a running server speaking SGLang's HTTP API (fake_sglang.py: real torch
    generation, a real gloo weight group) is registered mid-run, gets the trainer's weights
    through SGLang's weight group, generates groups, and is drained without losing one."""
    total = 1000
    cfg = small_config(
        "x.yaml",
        run_name="x",
        mode="async",
        rollout={"max_staleness": 4},
        train={"total_steps": total, "checkpoint_every": 500},
        services=SERVICES,
    )
    proc, _, queue, client = _start_run(cfg)
    _wait("step 10", lambda: _trainer_version(queue) >= 10, proc)
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.fake_sglang",
            "--port",
            str(port),
            "--checkpoint",
            os.path.abspath(find_resume_checkpoint(".relax/checkpoints", "x")),
        ],
        cwd=ROOT,
    )
    sglang = SGLangClient(f"http://127.0.0.1:{port}")
    try:
        wait_healthy(sglang, 120, server)
        asked_at = _trainer_version(queue)
        op = client.register([sglang.url])
        assert op["status"] == "running" and op["engines"] == ["rollout-1"]
        done = client.wait(op, timeout_s=240, poll_s=0.1)
        assert done["status"] == "succeeded", done
        pool = {e["name"]: e for e in client.engines()["engines"]}
        assert pool["rollout-1"]["url"] == sglang.url and pool["rollout-1"]["state"] == "active"
        _wait("rollout-1's groups", lambda: len(_entries_of(queue, "rollout-1")) >= 3, proc)
        served = int(sglang.get("/get_model_info")["weight_version"])
        assert served >= asked_at  # the trainer's weights, not the server's launch weights
        kinds = [e[1] for e in sglang.get("/relax_test/events")]
        assert kinds.count("update_end") >= 2 and kinds.count("generate_end") >= 3

        op = client.scale_in(engines=["rollout-1"])
        done = client.wait(op, timeout_s=240, poll_s=0.1)
        assert done["status"] == "succeeded", done
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
    finally:
        server.kill()
        server.wait()
        if proc.poll() is None:
            proc.kill()

    state = read_state(find_resume_checkpoint(".relax/checkpoints", "x"))
    assert state["policy_version"] == total
    added = _entries_of(queue, "rollout-1")
    assert added and min(m["policy_version"] for m in added) >= asked_at
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == total * 4
