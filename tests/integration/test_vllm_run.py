"""Runs whose rollout a real vLLM server serves (configs/vllm-cpu.yaml: the CPU default's task
at head width 32, which vLLM's CPU attention takes): a colocate run and an async run at
max_staleness 1 learn; the async run's server is SIGKILLed mid-run and the run recovers with
nothing lost or trained twice; every trained row's log-probs are the trainer's at the version it
is stamped with, not the version before.

Both runs start from the config's warm start, prepared once per session (tests/policies.py)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import mlflow
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch

from relax_core.config import load_config, replace
from relax_core.models.policy import load_policy
from relax_core.queue.audit import audit_run
from relax_core.queue.open import open_queue
from relax_core.roles.reference import add_ref_logprobs
from relax_core.run.lifecycle import run
from relax_core.train.checkpoint import list_checkpoints, read_state
from tests.needs import vllm_python
from tests.policies import VLLM_CPU, cpu_default_policies

pytestmark = [pytest.mark.slow, pytest.mark.integration]

COLOCATE_STEPS = 12
COLOCATE_GAIN = 0.08
"""Measured (2026-12-07, seed 0, 30 steps): held-out 0.414 -> 0.590 and 0.613 in two runs (+17.6,
+19.9 points; the server's sampling is not seeded per request, so runs differ), and 0.562
(+14.8) already at step 10 of a third; the suite runs 12 (its budget). The bar is about half
of that and about two standard deviations of the difference of two 256-question evals above no
gain (sqrt((0.41 * 0.59 + 0.5 * 0.5) / 256) = 0.044)."""
ASYNC_STEPS = 12
ASYNC_GAIN = 0.08
"""Measured (2026-12-07, seed 0, 24 steps, the server killed at version 8): held-out 0.414 ->
0.605 and 0.602 (+19.1, +18.8 points); 16 steps passed the same bar in every run since. The
suite runs 12 (its budget), as the colocate run, whose gain was +14.8 by step 10."""
BOUND = 1e-4
"""Largest gap between a row's engine log-probs and the trainer's at its stamped version
(float32 on both sides; the server test measures ~5e-7 per token)."""


@pytest.fixture(scope="module")
def vllm_start(tmp_path_factory):
    """(policy cache dir, vLLM's Python): the config's warm start, prepared once."""
    python = vllm_python()
    return cpu_default_policies(tmp_path_factory, config=VLLM_CPU)[0], python


def vllm_config(workdir, start, **sections):
    cache, python = start
    cfg = load_config(str(VLLM_CPU))
    base = {
        "checkpoint": {"policy_cache_dir": cache, "dir": str(workdir / "ckpt")},
        "storage": {"root": str(workdir / "store")},
        "tracking": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db", "progress": False},
        "vllm": {"python": python},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return replace(cfg, **base)


@pytest.mark.timeout(900)
def test_a_colocate_run_on_vllm_learns(workdir, vllm_start, monkeypatch):
    monkeypatch.chdir(VLLM_CPU.parent.parent)  # the config's dataset paths are the repo's
    cfg = vllm_config(workdir, vllm_start, train={"eval_every": 0, "total_steps": COLOCATE_STEPS})
    summary = run(cfg)
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    assert 0.1 <= before <= 0.5
    assert after >= before + COLOCATE_GAIN, (before, after)


def _server_pid(url: str) -> int:
    """The pid of the vLLM API server listening at `url` (its command line names the port)."""
    port = url.rsplit(":", 1)[1]
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
            if b"vllm.entrypoints.openai.api_server" in args and port.encode() in args:
                return int(pid)
    raise AssertionError(f"no vLLM server process for {url}")


def _kill_server_mid_run(store_root: str, killed: dict) -> None:
    """Once the trainer has sent a few versions, SIGKILL the rollout worker's vLLM server (its
    whole process group: API server, engine core, worker)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and "pid" not in killed:
        for path, _, files in os.walk(store_root):
            if path.endswith("control/sglang_servers") and "rollout-0" in files:
                with open(os.path.join(path, "rollout-0")) as f:
                    url = json.load(f)["url"]
                try:
                    import urllib.request

                    info = json.loads(
                        urllib.request.urlopen(f"{url}/weight_info", timeout=5).read()
                    )
                except OSError:
                    continue
                if (
                    str(info.get("weight_version", "")).isdigit()
                    and int(info["weight_version"]) >= 5
                ):
                    pid = _server_pid(url)
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                    killed.update(pid=pid, version=int(info["weight_version"]), url=url)
                    return
        time.sleep(0.2)


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, vllm_start):
    """An async run (max_staleness 1) on vLLM whose server is SIGKILLed mid-run."""
    workdir = tmp_path_factory.mktemp("vllm-async")
    cwd = os.getcwd()
    os.chdir(VLLM_CPU.parent.parent)
    cfg = vllm_config(
        workdir,
        vllm_start,
        run_name="va",
        mode="async",
        rollout={"max_staleness": 1},
        queue={"keep_versions": 100},
        train={
            "eval_every": 0,
            "total_steps": ASYNC_STEPS,
            "checkpoint_every": 1,
            "keep_checkpoints": 100,
            "deterministic": False,
        },
        services={"trainer_threads": 1, "rollout_threads": 1},
    )
    killed: dict = {}
    killer = threading.Thread(
        target=_kill_server_mid_run, args=(str(workdir / "store"), killed), daemon=True
    )
    killer.start()
    try:
        summary = run(cfg)
    finally:
        os.chdir(cwd)
    killer.join(5)
    yield cfg, summary, killed


def _history(cfg, run_id: str, key: str) -> list[tuple[int, float]]:
    client = mlflow.tracking.MlflowClient(tracking_uri=cfg.tracking.tracking_uri)
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.timeout(900)
def test_an_async_run_on_vllm_recovers_from_a_killed_server_and_learns(async_run):
    cfg, summary, killed = async_run
    assert "pid" in killed, "the server was never killed: the run ended first?"
    final = summary["checkpoint"]
    state = read_state(final)
    assert state["policy_version"] == ASYNC_STEPS
    queue = open_queue(cfg.queue, state["run_id"])
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == ASYNC_STEPS * cfg.rollout.groups_per_step
    with open(os.path.join(os.path.dirname(final), "recovery.json")) as f:
        recovery = json.load(f)
    assert recovery["role_restarts"].get("rollout-0", 0) >= 1, recovery
    # the restarted trainer trains again the step it died in: one value per step, the last
    staleness = dict(_history(cfg, state["tracking_run_id"], "train/staleness_max"))
    assert len(staleness) == ASYNC_STEPS, sorted(staleness)
    assert max(staleness.values()) <= 1
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    assert after >= before + ASYNC_GAIN, (before, after)


def test_async_vllm_rows_carry_the_log_probs_of_their_stamped_version(async_run):
    """Re-scored by the trainer's policy at the checkpoint of the version each row is stamped
    with, every trained row's engine log-probs match; at the version before they do not. The
    trainer reports the mismatch per staleness (mismatch/kl_s0, mismatch/kl_s1)."""
    cfg, summary, _ = async_run
    state = read_state(summary["checkpoint"])
    run_dir = os.path.dirname(summary["checkpoint"])
    checkpoints = {read_state(c)["policy_version"]: c for c in list_checkpoints(run_dir)}
    queue = open_queue(cfg.queue, state["run_id"])
    tables = [queue.read("rollout", seq) for seq in queue.committed("rollout")]
    by_version: dict[int, list] = {}
    for table in tables:
        for v in set(table.column("behaviour_version_min").to_pylist()):
            rows = pc.equal(table.column("behaviour_version_min"), v)
            by_version.setdefault(v, []).append(table.filter(rows))
    assert len(by_version) >= ASYNC_STEPS // 2, sorted(by_version)
    gaps_own, gaps_before = [], []
    for v, parts in sorted(by_version.items()):
        if v not in checkpoints:
            continue
        table = pa.concat_tables(parts)
        assert table.column("behaviour_version_max").to_pylist() == [v] * table.num_rows
        sampled = [torch.tensor(r) for r in table.column("rollout_logprobs").to_pylist()]
        for at, gaps in ((v, gaps_own), (v - 1, gaps_before)):
            if at not in checkpoints:
                continue
            model, tok = load_policy(checkpoints[at])
            scored = add_ref_logprobs(model, table, tok.pad_token_id, 4096, cfg.rollout.temperature)
            rescored = [torch.tensor(r) for r in scored.column("ref_logprobs").to_pylist()]
            gaps.append(
                max(float((a - b).abs().max()) for a, b in zip(sampled, rescored, strict=True))
            )
    assert len(gaps_own) >= ASYNC_STEPS // 2
    assert max(gaps_own) < BOUND, gaps_own
    assert min(gaps_before) > 1e-3, gaps_before
    for k in (0, 1):
        assert _history(cfg, state["tracking_run_id"], f"mismatch/kl_s{k}"), k
