"""A colocate run killed with SIGKILL and resumed ends exactly where an undisturbed run ends."""

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


def test_killed_run_resumes_at_the_checkpoint_and_matches_an_undisturbed_run(small_config, workdir):
    train = {"total_steps": STEPS, "checkpoint_every": 4, "steps_per_node": STEPS}
    undisturbed = small_config("a.yaml", run_name="a", train=train)
    proc = _run(undisturbed)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out

    killed = small_config("b.yaml", run_name="b", train=train)
    proc = _run(killed)
    run_root = workdir / ".relax" / "checkpoints"
    deadline = time.time() + 300
    while time.time() < deadline:  # kill once a checkpoint past v0 exists, mid-run
        found = find_resume_checkpoint(str(run_root), "b")
        if found and read_state(found)["policy_version"] >= 8:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = read_state(find_resume_checkpoint(str(run_root), "b"))
    assert 8 <= killed_at["policy_version"] < STEPS, "the run was not killed mid-way"

    resumed = small_config("b2.yaml", run_name="b", train=train, checkpoint={"resume": True})
    proc = _run(resumed)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out

    a_state, a_weights = _final(str(run_root), "a")
    b_state, b_weights = _final(str(run_root), "b")
    # Same run continued: same run id and MLflow run, not a new one.
    assert b_state["run_id"] == killed_at["run_id"]
    assert b_state["tracking_run_id"] == killed_at["tracking_run_id"]
    # Same dataset position and queue position as the undisturbed run ...
    assert b_state["policy_version"] == a_state["policy_version"] == STEPS
    assert b_state["dataset_cursor"] == a_state["dataset_cursor"]
    # ... and the very same weights: the resumed steps saw the same prompts, samples and optimizer.
    for name, tensor in a_weights.items():
        torch.testing.assert_close(b_weights[name], tensor, rtol=0, atol=0)
    # Every version of the resumed run kept its checkpoint chain from the kill point on.
    versions = [
        read_state(c)["policy_version"]
        for c in list_checkpoints(os.path.dirname(find_resume_checkpoint(str(run_root), "b")))
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
