"""`rollout.engine: sglang` in real runs, on CPU.

SGLang cannot run here, so `python -m sglang.launch_server` resolves to tests/integration/
sglang_shim (SGLang's command line, parsed strictly) serving tests/integration/fake_sglang.py (the
documented HTTP API, generating with a torch policy, joining weight groups over gloo). Everything
else is the product: the rollout workers start their servers with `SGLangServer` and stop them,
publish them, the trainer forms SGLang's weight group with them and updates them every step; in
colocate mode the server gives its memory back while the trainer runs and loads each version from
disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from relax_core.config import SGLangConfig
from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.rollout.sglang_engine import SGLangEngine, SGLangError
from relax_core.rollout.sglang_server import SGLangServer, publish_policy, server_command
from relax_core.train.checkpoint import find_resume_checkpoint, read_state
from tests.runs import _argv, _mentioning, running

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIM = os.path.join(ROOT, "tests", "integration", "sglang_shim")
SERVICES = {"trainer_threads": 1, "poll_s": 0.002, "heartbeat_s": 0.2}


@pytest.fixture
def sglang_on_path(monkeypatch, workdir):
    """Child processes find the test `sglang` package (and this repo's tests package)."""
    path = os.pathsep.join([SHIM, ROOT, os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)
    record = workdir / "sglang-argv.jsonl"
    monkeypatch.setenv("RELAX_TEST_SGLANG_ARGV", str(record))
    return record


@pytest.fixture
def tiny_checkpoint(tmp_path) -> str:
    """A policy directory as a checkpoint holds it (model, tokenizer, state.json, optimizer)."""
    from tests.integration.weight_sync_actors import tiny_policy

    model, tok = tiny_policy(0)
    path = tmp_path / "step_000000"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "state.json").write_text('{"policy_version": 0}')
    (path / "optimizer.pt").write_bytes(b"")
    return str(path)


def test_the_command_line_says_what_sglang_needs():
    cfg = SGLangConfig(mem_fraction_static=0.7, extra_args="--dp-size 2 --log-level warning")
    cmd = server_command("/venv/bin/python", "/m", 31000, 4, 12, cfg, memory_saver=True)
    assert cmd[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    flags = {a: b for a, b in zip(cmd, cmd[1:], strict=False) if a.startswith("--")}
    assert flags["--model-path"] == "/m" and flags["--port"] == "31000"
    assert flags["--tp-size"] == "4" and flags["--weight-version"] == "12"
    assert flags["--mem-fraction-static"] == "0.7"
    assert "--skip-tokenizer-init" in cmd and "--enable-memory-saver" in cmd
    assert cmd[-4:] == ["--dp-size", "2", "--log-level", "warning"]


@pytest.mark.slow
def test_a_started_server_serves_and_stops_with_its_process_group(
    sglang_on_path, tiny_checkpoint, tmp_path
):
    cfg = SGLangConfig(start_timeout_s=120)
    server = SGLangServer.start(tiny_checkpoint, cfg, 1, 7, str(tmp_path / "s.log"))
    try:
        engine = SGLangEngine(server.client)
        assert engine.refresh_version() == 7  # --weight-version reached the server
        from relax_core.rollout.engine import SamplingParams

        out = engine.generate([[1, 5, 6]], SamplingParams(3))
        assert len(out[0].response_ids) == len(out[0].logprobs) <= 3
        pid = server.proc.pid
    finally:
        server.stop()
    assert not running(pid)
    with pytest.raises(SGLangError, match="unreachable"):
        server.client.get("/health")


def test_a_server_that_cannot_start_is_named_with_its_log(sglang_on_path, tmp_path):
    cfg = SGLangConfig(start_timeout_s=60, extra_args="--no-such-flag")
    with pytest.raises(SGLangError, match="exited with code 2.*s.log"):
        SGLangServer.start(str(tmp_path), cfg, 1, 0, str(tmp_path / "s.log"))
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "s.log").read_text()


def test_a_sidecar_gets_the_policy_whole_and_ready_last(tiny_checkpoint, tmp_path):
    target = tmp_path / "models" / "policy"
    publish_policy(tiny_checkpoint, str(target), 3)
    names = set(os.listdir(target))
    assert {"READY", "VERSION", "config.json", "model.safetensors"} <= names
    assert "state.json" not in names and "optimizer.pt" not in names
    assert (target / "VERSION").read_text() == "3"
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        publish_policy(str(tmp_path / "models"), str(tmp_path / "other"), 0)
    assert not (tmp_path / "other").exists()


def _run(cfg: str, timeout: float = 600) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    return out.stdout + out.stderr


@pytest.mark.slow
def test_an_async_run_on_sglang_engines_trains_every_group_once(
    small_config, workdir, sglang_on_path, monkeypatch
):
    # A generate call of one group takes 0.25 s: the 32 groups keep one worker busy for 8 s,
    # longer than the other's server takes to start, so both take part however loaded the
    # machine is when they start.
    monkeypatch.setenv("RELAX_TEST_SGLANG_DELAY_S", "0.25")
    total = 8
    cfg = small_config(
        "sg.yaml",
        run_name="sg",
        mode="async",
        rollout={"engine": "sglang", "max_staleness": 1},
        train={"total_steps": total, "checkpoint_every": 500},
        services={**SERVICES, "rollout_workers": 2, "rollout_batch_groups": 1},
        sglang={"start_timeout_s": 120},
    )
    _run(cfg)
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "sg"))
    assert state["policy_version"] == total
    queue = TransferQueue(".relax/queue", state["run_id"])
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    # A server for each worker, started with the checkpoint's version, and one for each of the
    # held-out evaluations (before the first step and after the last), on their versions.
    launches = [json.loads(line) for line in sglang_on_path.read_text().splitlines()]
    versions = sorted(a[a.index("--weight-version") + 1] for a in launches)
    assert versions == ["0", "0", "0", str(total)]
    logs = os.path.join(".relax/checkpoints", state["run_id"], "logs")
    for worker in ("rollout-0", "rollout-1"):
        with open(os.path.join(logs, f"{worker}.log")) as f:
            assert f"{worker} drives the SGLang server at http://127.0.0.1:" in f.read()
    # Rows generated after the first update carry the versions the servers reported.
    versions = [
        queue.record("rollout", seq)["meta"]["policy_version"] for seq in queue.committed("rollout")
    ]
    assert max(versions) >= total - 2
    # The trainer recorded the SGLang weight group: rank 0 itself, each server at its offset.
    group = json.loads(queue.store.read_bytes("control/rendezvous/sglang"))
    assert group["world_size"] == 3 and group["backend"] == "gloo"
    assert group["rank_offsets"] == {"rollout-0": 1, "rollout-1": 2}
    # The servers are stopped with their workers and withdrawn from the pool.
    assert not queue.store.exists("control/sglang_servers/rollout-0")
    assert {"sglang-rollout-0.log", "sglang-rollout-1.log"} <= set(os.listdir(logs))
    deadline = time.monotonic() + 30  # SIGTERM ends a stand-in at once; 30 s on a loaded box
    while (left := _servers_started_in(workdir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"SGLang servers outlived the run: {[' '.join(_argv(p)) for p in left]}"


def _servers_started_in(where) -> list[int]:
    """The stand-in servers still running that this test started: those whose command line
    names its own temp dir (their --model-path), not another test's (another xdist worker's)."""
    return [
        pid
        for pid in _mentioning(os.path.join(str(where), ""))  # its own dir, not a sibling
        if running(pid) and "sglang.launch_server" in _argv(pid)
    ]


@pytest.mark.slow
def test_a_killed_rollout_worker_takes_its_server_with_it(
    sglang_on_path, tiny_checkpoint, tmp_path
):
    code = (
        "import sys, time\n"
        "from relax_core.config import SGLangConfig\n"
        "from relax_core.rollout.sglang_server import SGLangServer\n"
        "s = SGLangServer.start(sys.argv[1], SGLangConfig(start_timeout_s=120), 1, 0, sys.argv[2])\n"
        "print(s.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    worker = subprocess.Popen(
        [sys.executable, "-c", code, tiny_checkpoint, str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = None
    try:
        line = worker.stdout.readline()  # once its server answers /health
        assert line.strip().isdigit(), f"the worker started no server: {line!r}"
        pid = int(line)
        # The test's own servers are told apart from any other test's by their command line.
        assert _servers_started_in(tmp_path) == [pid]
        worker.send_signal(signal.SIGKILL)
        worker.wait()
        deadline = time.monotonic() + 20  # SIGTERM (its parent-death signal) ends it at once
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(pid), "the server outlived its killed rollout worker by 20 s"
    finally:
        worker.kill()
        worker.wait()
        if pid is not None and running(pid):
            os.killpg(pid, signal.SIGKILL)  # its own session: the server and its children


@pytest.mark.slow
def test_a_colocate_run_on_sglang_takes_turns_with_the_trainer(
    small_config, workdir, sglang_on_path, monkeypatch
):
    events_file = workdir / "sglang-events.jsonl"
    monkeypatch.setenv("RELAX_TEST_SGLANG_EVENTS", str(events_file))
    total = 4
    cfg = small_config(
        "co.yaml",
        run_name="co",
        rollout={"engine": "sglang"},
        train={"total_steps": total, "checkpoint_every": 500, "steps_per_node": 10},
        sglang={"start_timeout_s": 120, "handoff_dir": str(workdir / "handoff")},
    )
    _run(cfg)
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "co"))
    assert state["policy_version"] == total
    events = [json.loads(line)[1:] for line in events_file.read_text().splitlines()]
    kinds = [e[0] for e in events]
    # Every step: generate, give the memory back, load the next version from disk, wake up.
    loads = [e[1] for e in events if e[0] == "update_end"]
    assert loads == [str(v) for v in range(1, total + 1)]
    assert kinds.count("release") == total
    released = False
    for kind, *rest in events:
        if kind == "release":
            released = True
        elif kind == "resume_memory" and "kv_cache" in rest[0]:
            released = False
        elif kind == "generate_start":
            assert not released, "generation while the trainer held the memory"
    # Handed-over versions are removed once loaded (node-local memory on a cluster).
    handoff = workdir / "handoff" / state["run_id"]
    assert not handoff.exists() or not os.listdir(handoff)
