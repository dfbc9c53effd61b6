"""Starting a run: the MLflow run opens beside the step-0 eval, and a start that fails leaves no
MLflow run behind marked as still running."""

from __future__ import annotations

import os
import threading

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
import torch
from mlflow.tracking import MlflowClient

from relax_core.config import load_config, replace
from relax_core.data.dataset import fingerprint
from relax_core.run import lifecycle
from relax_core.run.prepare import PolicySpec, prepare_policy
from relax_core.train.checkpoint import read_state

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_config(tmp_path, name: str = "cpu-default.yaml", eval_size: int = 32, **sections):
    """configs/`name` with the repo's data, `eval_size` held-out rows, every place a run writes
    under `tmp_path`, no warm start unless `sections` give one, and `sections` over it."""
    cfg = load_config(os.path.join(REPO, "configs", name))
    cfg = replace(
        cfg,
        warm_start={"steps": 0},
        data={
            "train_path": os.path.join(REPO, cfg.data.train_path),
            "eval_path": os.path.join(REPO, cfg.data.eval_path),
            "eval_size": eval_size,
        },
        queue={"root": str(tmp_path / "queue")},
        checkpoint={"dir": str(tmp_path / "ckpt"), "policy_cache_dir": str(tmp_path / "policies")},
        storage={"root": str(tmp_path / "storage")},
        tracking={"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "progress": False},
    )
    return replace(cfg, **sections) if sections else cfg


def policy_of(cfg) -> str:
    spec = PolicySpec.of(cfg, fingerprint(cfg.data.train_path))
    return prepare_policy(spec, cfg.checkpoint.policy_cache_dir)


def opening_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("relax-mlflow")]


def test_start_records_step_0_in_the_run_it_opened(tmp_path):
    torch.set_num_threads(1)
    cfg = run_config(tmp_path)
    checkpoint = lifecycle.start_run(cfg, policy_of(cfg))
    assert not opening_threads()
    state = read_state(checkpoint)
    client = MlflowClient(cfg.tracking.tracking_uri)
    run = client.get_run(state["tracking_run_id"])
    assert run.info.status == "RUNNING"
    assert run.data.params["seed"] == str(cfg.seed)
    (eval0,) = client.get_metric_history(run.info.run_id, "eval/accuracy")
    assert eval0.step == 0 and eval0.value == pytest.approx(state["eval_before"]["eval/accuracy"])


def test_a_failed_start_ends_its_mlflow_run_failed(tmp_path):
    torch.set_num_threads(1)
    cfg = run_config(tmp_path)
    policy = policy_of(cfg)
    # The prepared policy's weights are damaged: the session cannot load them, while MLflow
    # opens the run beside it.
    (weights,) = [f for f in os.listdir(policy) if f.endswith(".safetensors")]
    with open(os.path.join(policy, weights), "r+b") as f:
        f.truncate(64)
    with pytest.raises(Exception):  # noqa: B017 - whichever error the loader raises
        lifecycle.start_run(cfg, policy)
    assert not opening_threads()
    client = MlflowClient(cfg.tracking.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"
    assert not os.path.exists(cfg.checkpoint.dir) or not os.listdir(cfg.checkpoint.dir)


@pytest.mark.slow
def test_the_launcher_runs_a_fresh_process_through_start_and_steps(tmp_path):
    """A whole run in a new process, where nothing imported mlflow before the MLflow run opens
    beside the step-0 eval."""
    import json
    import subprocess
    import sys

    from relax_core.config import config_to_dict

    cfg = replace(run_config(tmp_path), train={"total_steps": 2, "eval_every": 0})
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config_to_dict(cfg)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    done = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", str(path)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(cfg.tracking.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [0, 2]


def test_a_tracking_store_that_cannot_open_fails_the_start_with_its_own_error(tmp_path, caplog):
    torch.set_num_threads(1)
    cfg = replace(run_config(tmp_path), tracking={"tracking_uri": "nosuchscheme://nowhere"})
    with pytest.raises(Exception, match="nosuchscheme"):
        lifecycle.start_run(cfg, policy_of(cfg))
    assert not opening_threads()
    assert "could not end the MLflow run" not in caplog.text
    assert not os.path.exists(cfg.checkpoint.dir) or not os.listdir(cfg.checkpoint.dir)
