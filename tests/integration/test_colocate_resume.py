"""A colocate run killed with SIGKILL, or preempted with SIGTERM (which checkpoints the step under
way), and resumed ends exactly where an undisturbed run ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from relax_core.queue import TransferQueue
from relax_core.train.checkpoint import find_resume_checkpoint, list_checkpoints, read_state

pytestmark = pytest.mark.integration

STEPS = 24


def _run(cfg_path: str, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def _final(root: str, name: str) -> tuple[dict, dict]:
    ckpt = find_resume_checkpoint(root, name)
    assert ckpt is not None
    return read_state(ckpt), load_file(os.path.join(ckpt, "model.safetensors"))


def _stop_mid_run(cfg_path: str, run_root: str, name: str, sig: int) -> tuple[dict, str]:
    """Start the run, send `sig` once a checkpoint past v0 exists; (newest state, output)."""
    proc = _run(cfg_path)
    deadline = time.time() + 300
    while time.time() < deadline:  # stop once a checkpoint past v0 exists, mid-run
        found = find_resume_checkpoint(run_root, name)
        if found and read_state(found)["policy_version"] >= 8:
            break
        time.sleep(0.02)
    if sig == signal.SIGTERM:
        time.sleep(0.15)  # into a step that is not a checkpoint's
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=300)
    if sig == signal.SIGTERM:
        assert proc.returncode == 128 + signal.SIGTERM, out
    return read_state(find_resume_checkpoint(run_root, name)), out


@pytest.mark.slow
def test_killed_or_preempted_run_resumes_and_matches_an_undisturbed_run(small_config, workdir):
    train = {"total_steps": STEPS, "checkpoint_every": 4, "steps_per_node": STEPS}
    undisturbed = small_config("a.yaml", run_name="a", train=train)
    proc = _run(undisturbed)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    run_root = str(workdir / ".relax" / "checkpoints")

    # SIGKILL: the run resumes from its newest periodic checkpoint.
    killed_at, _ = _stop_mid_run(
        small_config("b.yaml", run_name="b", train=train), run_root, "b", signal.SIGKILL
    )
    assert 8 <= killed_at["policy_version"] < STEPS, "the run was not killed mid-way"
    # SIGTERM (a pod preempted): the step under way ends and is checkpointed, whatever the
    # checkpoint_every; every step the queue saw trained is in that checkpoint.
    cfg_c = small_config("c.yaml", run_name="c", train=train)
    preempted_at, out = _stop_mid_run(cfg_c, run_root, "c", signal.SIGTERM)
    version = preempted_at["policy_version"]
    assert 8 <= version < STEPS, "the run was not preempted mid-way"
    assert f"preempted (SIGTERM): checkpoint of policy version {version} written at" in out
    assert "checkpoint.resume: true" in out
    queue = TransferQueue(str(workdir / ".relax" / "queue"), preempted_at["run_id"])
    assert len(queue.committed("ready")) == version, "a step trained before SIGTERM was lost"

    for name, stopped_at in (("b", killed_at), ("c", preempted_at)):
        resumed = small_config(
            f"{name}2.yaml", run_name=name, train=train, checkpoint={"resume": True}
        )
        proc = _run(resumed)
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out
        _same_as_undisturbed(workdir, run_root, name, stopped_at)


def _same_as_undisturbed(workdir, run_root: str, name: str, killed_at: dict) -> None:
    a_state, a_weights = _final(run_root, "a")
    b_state, b_weights = _final(run_root, name)
    # Same run continued: same run id and MLflow run, not a new one.
    assert b_state["run_id"] == killed_at["run_id"]
    assert b_state["tracking_run_id"] == killed_at["tracking_run_id"]
    # Same dataset position and queue position as the undisturbed run ...
    assert b_state["policy_version"] == a_state["policy_version"] == STEPS
    assert b_state["dataset_cursor"] == a_state["dataset_cursor"]
    # ... and the very same weights: the resumed steps saw the same prompts, samples and optimizer.
    for key, tensor in a_weights.items():
        torch.testing.assert_close(b_weights[key], tensor, rtol=0, atol=0)
    # Every version of the resumed run kept its checkpoint chain from the kill point on.
    versions = [
        read_state(c)["policy_version"]
        for c in list_checkpoints(os.path.dirname(find_resume_checkpoint(run_root, name)))
    ]
    assert versions[-1] == STEPS and killed_at["policy_version"] in versions

    # The trainer neither repeated nor skipped a batch: after the resume, step s trained the
    # `ready` entry written for version s - 1, each entry once, in queue order; the entries the
    # killed process wrote after its checkpoint were passed over (their prompts regenerated).
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    last_seq: dict[int, float] = {}
    history = client.get_metric_history(b_state["tracking_run_id"], "queue/ready_seq")
    for m in sorted(history, key=lambda m: m.timestamp):
        last_seq[m.step] = m.value
    assert sorted(last_seq) == list(range(1, STEPS + 1))
    seqs = [int(last_seq[step]) for step in range(1, STEPS + 1)]
    assert seqs == sorted(set(seqs)), "a ready entry was trained twice or out of order"
    queue = TransferQueue(str(workdir / ".relax" / "queue"), b_state["run_id"])
    versions = [queue.record("ready", seq)["meta"]["policy_version"] for seq in seqs]
    assert versions == list(range(STEPS))
    orphans = sorted(set(queue.committed("ready")) - set(seqs))
    assert all(
        killed_at["policy_version"] <= queue.record("ready", s)["meta"]["policy_version"]
        for s in orphans
    )
