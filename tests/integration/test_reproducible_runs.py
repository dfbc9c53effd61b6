"""The same config and seed on the same machine give the same run bit for bit: every train/*,
eval/* and mismatch/* metric at every step, and the final weights. Each run is its own process
with its own PYTHONHASHSEED; the second reuses the policy the first prepared, as reruns do.

The CPU default's model, data and RL settings, with a short warm start and a few steps: enough
for a divergence to show, since gradients that differ in their last bit at step 1 already give
different weights. A policy that short a warm start leaves is rarely right, so few groups have
an advantage; an entropy bonus gives every row a gradient, as a longer warm start would.
"""

from __future__ import annotations

import os
import subprocess
import sys

import mlflow
import pytest
import yaml
from safetensors.torch import load_file

from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("train/", "eval/", "mismatch/")


def _config(workdir, base: str, name: str, steps: int, **sections) -> str:
    with open(os.path.join(REPO, "configs", base)) as f:
        cfg = yaml.safe_load(f)
    cfg["run_name"] = name
    cfg["warm_start"]["steps"] = 10
    cfg["data"]["eval_size"] = 32
    cfg["algorithm"]["entropy_coef"] = 0.01
    # Two threads whatever the machine has: a kernel that sums in a varying order shows only
    # when more than one thread adds.
    cfg["train"].update(
        total_steps=steps,
        eval_every=2,
        checkpoint_every=steps,
        steps_per_node=steps,
        torch_threads=2,
    )
    cfg["tracking"] = {
        "experiment": "repro",
        "tracking_uri": f"sqlite:///{workdir}/mlflow.db",
        "progress": False,
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _run(cfg_path: str, hash_seed: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONHASHSEED": hash_seed}
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _outcome(workdir, name: str, steps: int) -> tuple[dict, dict]:
    """(metric name -> [(step, value)], final weights) of the run `name`."""
    ckpt = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), name)
    assert ckpt is not None
    state = read_state(ckpt)
    assert state["policy_version"] == steps
    client = mlflow.MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    names = client.get_run(state["tracking_run_id"]).data.metrics
    history = {
        key: sorted(
            (m.step, m.value) for m in client.get_metric_history(state["tracking_run_id"], key)
        )
        for key in names
        if key.startswith(COMPARED)
    }
    # What is compared is there: a loss at every step, evals before, during and after.
    assert [step for step, _ in history["train/pg_loss"]] == list(range(1, steps + 1))
    assert [step for step, _ in history["eval/accuracy"]] == [0, 2, steps]
    return history, load_file(os.path.join(ckpt, "model.safetensors"))


def _assert_same_run(workdir, steps: int) -> None:
    history_a, weights_a = _outcome(workdir, "a", steps)
    history_b, weights_b = _outcome(workdir, "b", steps)
    assert history_a.keys() == history_b.keys()
    for key, values in history_a.items():
        assert values == history_b[key], key
    assert weights_a.keys() == weights_b.keys()
    for name, tensor in weights_a.items():
        assert weights_b[name].equal(tensor), name


def test_colocate_runs_repeat_bit_for_bit(workdir):
    """configs/cpu-default.yaml as it ships (train.deterministic on)."""
    steps = 4
    _run(_config(workdir, "cpu-default.yaml", "a", steps), hash_seed="1")
    _run(_config(workdir, "cpu-default.yaml", "b", steps), hash_seed="2")
    _assert_same_run(workdir, steps)


@pytest.mark.slow  # three role processes per run: about a minute for both on 2 cores
def test_async_runs_at_staleness_zero_repeat_bit_for_bit(workdir):
    """configs/cpu-async.yaml made strict on-policy, with train.deterministic."""
    steps = 3
    on_policy = {
        "rollout": {"max_staleness": 0},
        "train": {"deterministic": True},
        "services": {"poll_s": 0.002, "heartbeat_s": 0.2},
    }
    for name, hash_seed in (("a", "1"), ("b", "2")):
        _run(_config(workdir, "cpu-async.yaml", name, steps, **on_policy), hash_seed)
    _assert_same_run(workdir, steps)
