"""Elastic rollout against a real async run: every role an OS process, weights over gloo, the
scaling API on loopback, driven through `ScaleClient` (what `relax scale` uses).

One run, asserted many ways. Mid-run, a wrong token and a bad target are refused and start
nothing; a scale-out adds an engine that takes work only with the trainer's current weights; a
running server speaking SGLang's HTTP API (fake_sglang.py: real torch generation, a real gloo
weight group) is registered by URL, gets the trainer's weights through SGLang's weight group and
generates groups; both are drained (by name, then by target). The run is then stopped the way a
pod is (SIGTERM: the trainer checkpoints its step), so it lasts only as long as the operations,
and the audit of that checkpoint finds no group lost or trained twice.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from relax_core.config import load_config
from relax_core.data import PromptSampler, load_prompts
from relax_core.ops.scale_client import ScaleApiError, ScaleClient
from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.queue.coverage import coverage_errors, read_prompt_coverage
from relax_core.rollout.server_client import wait_healthy
from relax_core.rollout.sglang_engine import SGLangClient
from relax_core.train import preemption
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


def _start_sglang(checkpoint: str) -> tuple[subprocess.Popen, SGLangClient]:
    """The external server, launched with the run's first checkpoint (weight version 0)."""
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.fake_sglang", "--port", str(port)]
        + ["--checkpoint", os.path.abspath(checkpoint)],
        cwd=ROOT,
    )
    return server, SGLangClient(f"http://127.0.0.1:{port}")


def _trainer_version(queue: TransferQueue) -> int:
    return max(
        (b["info"].get("policy_version", 0) for b in queue.heartbeats() if b["role"] == "trainer"),
        default=0,
    )


def _entries_of(queue: TransferQueue, worker: str) -> list[dict]:
    metas = [queue.record("rollout", seq)["meta"] for seq in queue.committed("rollout")]
    return [m for m in metas if m["worker"] == worker]


def _succeeded(client: ScaleClient, op: dict) -> None:
    done = client.wait(op, timeout_s=240, poll_s=0.1)
    assert done["status"] == "succeeded", done


@pytest.mark.slow
def test_engines_scale_out_register_and_drain_mid_run_and_no_group_is_lost(small_config, workdir):
    cfg = small_config(
        "e.yaml",
        run_name="e",
        mode="async",
        rollout={"max_staleness": 4},
        # The run never reaches its last step: it is stopped once the operations are done.
        train={"total_steps": 1_000_000, "checkpoint_every": 1_000_000},
        services=SERVICES,
    )
    proc, api_file, queue, client = _start_run(cfg)
    run_dir = os.path.dirname(api_file)
    first = _wait(
        "the first checkpoint", lambda: find_resume_checkpoint(".relax/checkpoints", "e"), proc
    )
    server, sglang = _start_sglang(first)  # starts while the run warms up
    try:
        _wait("step 10", lambda: _trainer_version(queue) >= 10, proc)

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

        # A spawned engine.
        asked_at = {"rollout-1": _trainer_version(queue)}
        op = client.scale_out(2)
        assert op["status"] == "running" and op["engines"] == ["rollout-1"]
        _succeeded(client, op)

        # An external SGLang server, registered by URL.
        wait_healthy(sglang, 120, server, path="/ready")
        asked_at["rollout-2"] = _trainer_version(queue)
        op = client.register([sglang.url])
        assert op["status"] == "running" and op["engines"] == ["rollout-2"]
        _succeeded(client, op)
        pool = {e["name"]: e for e in client.engines()["engines"]}
        assert pool["rollout-2"]["url"] == sglang.url and pool["rollout-2"]["state"] == "active"
        assert pool["rollout-1"]["state"] == "active" and "url" not in pool["rollout-1"]
        for worker in asked_at:
            _wait(f"{worker}'s groups", lambda w=worker: len(_entries_of(queue, w)) >= 3, proc)
        served = int(sglang.get("/model_info")["weight_version"])
        assert served >= asked_at["rollout-2"]  # the trainer's weights, not its launch weights
        kinds = [e[1] for e in sglang.get("/relax_test/events")]
        assert kinds.count("update_end") >= 2 and kinds.count("generate_end") >= 3

        # Drained: the external one by name, then the spawned one by target.
        op = client.scale_in(engines=["rollout-2"])
        assert op["engines"] == ["rollout-2"]
        _succeeded(client, op)
        op = client.scale_in(target=1)
        assert op["engines"] == ["rollout-1"]
        _succeeded(client, op)
        pool = client.engines()
        assert [(e["name"], e["state"]) for e in pool["engines"]] == [
            ("rollout-0", "active"),
            ("rollout-1", "removed"),
            ("rollout-2", "removed"),
        ]
        drained_at = _trainer_version(queue)

        proc.send_signal(signal.SIGTERM)  # as a pod being stopped
        out, _ = proc.communicate(timeout=240)
    finally:
        server.kill()
        server.wait()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == preemption.EXIT_CODE, out
    stopped_at = re.search(r"preempted \(SIGTERM\): checkpoint of policy version (\d+)", out)
    assert stopped_at, out
    assert not os.path.exists(api_file)  # the API ends with the run

    state = read_state(find_resume_checkpoint(".relax/checkpoints", "e"))
    assert state["policy_version"] == int(stopped_at.group(1)) >= drained_at
    # Each added engine generated only with the trainer's weights of its time, never with the
    # step-0 weights it (or its server) launched with, and committed every group it admitted.
    for worker, version in asked_at.items():
        added = _entries_of(queue, worker)
        assert added and min(m["policy_version"] for m in added) >= version, worker
    with open(f"{run_dir}/roles.json") as f:
        roles = json.load(f)
    rollouts = [(r["worker"], r["exit_code"]) for r in roles if r["role"] == "rollout"]
    # One process each; the added ones drained and exited on their own, before the stop.
    assert [w for w, _ in rollouts] == [0, 1, 2] and rollouts[1:] == [(1, 0), (2, 0)]
    trainer = [r["exit_code"] for r in roles if r["role"] == "trainer"]
    assert trainer == [preemption.EXIT_CODE]  # it checkpointed its step, then exited
    with open(f"{run_dir}/recovery.json") as f:
        recovery = json.load(f)
    assert [op["status"] for op in recovery["scale_operations"]] == ["succeeded"] * 4
    assert recovery["events"] == []  # nothing failed on the way
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == state["policy_version"] * 4
    # From the dataset and the queue alone (not the trained records, not the cursor): the
    # engines added and drained mid-run skipped no position of the prompt stream, and none of
    # its prompts was trained twice.
    sampler = PromptSampler(len(load_prompts(load_config(cfg).data.train_path)), seed=0)
    coverage = read_prompt_coverage(queue, sampler.num_prompts, sampler.order)
    assert coverage_errors(coverage) == 0 and coverage["never_issued"] == 0, json.dumps(coverage)
    assert coverage["trained_once"] == state["policy_version"] * 4, coverage
