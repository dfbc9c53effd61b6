"""The same config and seed on the same machine give the same run bit for bit: every train/*,
eval/* and mismatch/* metric at every step, and the final weights. The first run of a pair runs
in this process (`lifecycle.run`, what `python -m relax_core.entrypoints.run` calls), after
whatever this process ran before; the second is a process of its own with another
PYTHONHASHSEED. Every run reuses the policy the first of this module prepared, as reruns do.

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
import torch
import yaml
from safetensors.torch import load_file

from relax_core.config import load_config
from relax_core.run.lifecycle import run
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMPARED = ("train/", "eval/", "mismatch/")


@pytest.fixture(scope="module")
def policy_cache(tmp_path_factory) -> str:
    """One warm start for both tests: the two configs' starting policies are the same one."""
    return str(tmp_path_factory.mktemp("repro-policies"))


def _config(workdir, policies: str, base: str, name: str, steps: int, **sections) -> str:
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
    cfg.setdefault("checkpoint", {})["policy_cache_dir"] = policies
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


def _run_here(cfg_path: str) -> None:
    """The run in this process; the torch settings it makes for itself are undone after."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    try:
        run(load_config(cfg_path))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _run(cfg_path: str) -> None:
    """The run in a process of its own, with a hash seed other than this process's."""
    ours = os.environ.get("PYTHONHASHSEED", "")
    hash_seed = str(int(ours) + 1) if ours.isdigit() else "1"
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


@pytest.mark.slow
def test_colocate_runs_repeat_bit_for_bit(workdir, policy_cache):
    """configs/cpu-default.yaml as it ships (train.deterministic on)."""
    steps = 3
    _run_here(_config(workdir, policy_cache, "cpu-default.yaml", "a", steps))
    _run(_config(workdir, policy_cache, "cpu-default.yaml", "b", steps))
    _assert_same_run(workdir, steps)


@pytest.mark.slow  # three role processes per run: about a minute for both on 2 cores
def test_async_runs_at_staleness_zero_repeat_bit_for_bit(workdir, policy_cache):
    """configs/cpu-async.yaml made strict on-policy, with train.deterministic."""
    steps = 3
    on_policy = {
        "rollout": {"max_staleness": 0},
        "train": {"deterministic": True},
        "services": {"poll_s": 0.002, "heartbeat_s": 0.2},
    }
    _run_here(_config(workdir, policy_cache, "cpu-async.yaml", "a", steps, **on_policy))
    _run(_config(workdir, policy_cache, "cpu-async.yaml", "b", steps, **on_policy))
    _assert_same_run(workdir, steps)
