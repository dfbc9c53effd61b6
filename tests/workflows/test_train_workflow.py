"""The `train` workflow through `pyflyte run` (real flytekit local execution, real MLflow store)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mlflow.tracking import MlflowClient

from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEP_METRICS = [
    "train/reward_mean",
    "train/accuracy",
    "train/response_length",
    "train/kl",
    "train/entropy",
    "train/clip_frac",
    "train/grad_norm",
    "perf/step_s",
    "perf/rollout_s",
    "perf/train_s",
    "perf/tokens_per_s",
]


def _pyflyte(cfg_path: str, cwd, **env_vars: str) -> subprocess.CompletedProcess:
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "pyflyte"),
        "run",
        os.path.join(REPO, "workflows", "train.py"),
        "train",
        "--cfg",
        cfg_path,
    ]
    env = {**os.environ, "PYTHONPATH": REPO, **env_vars}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def test_pyflyte_run_trains_logs_checkpoints_and_resumes(small_config, workdir):
    cfg = small_config(
        train={"total_steps": 4, "steps_per_node": 1, "checkpoint_every": 2},
        tracking={"registered_model": "relax-t"},
    )
    # What Flyte sets in every task pod of a cluster execution.
    flyte_env = {
        "FLYTE_INTERNAL_EXECUTION_ID": "f3a9c2e1b",
        "FLYTE_INTERNAL_EXECUTION_PROJECT": "relax",
        "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development",
        "FLYTE_INTERNAL_EXECUTION_WORKFLOW": "workflows.train.train",
        "FLYTE_INTERNAL_TASK_VERSION": "v42",
    }
    first = _pyflyte(cfg, workdir, **flyte_env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "Run summary" in first.stderr and "eval accuracy" in first.stderr
    assert "model         models:/relax-t/1" in first.stderr

    ckpt = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "t")
    state = read_state(ckpt)
    # four rl_steps nodes of one step each, in two rl_segment nodes of two
    assert state["policy_version"] == 4

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.get_run(state["tracking_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.params["train.total_steps"] == "4"
    assert run.data.tags["flyte.execution_id"] == "f3a9c2e1b"
    assert run.data.tags["flyte.version"] == "v42"
    assert run.data.tags["flyte.workflow"] == "workflows.train.train"
    assert client.get_model_version("relax-t", "1").run_id == run.info.run_id
    for name in STEP_METRICS:
        assert [m.step for m in client.get_metric_history(run.info.run_id, name)] == [1, 2, 3, 4]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/accuracy")] == [0, 4]

    # Resume with a longer horizon: continues the same run from step 4, not from scratch.
    more = small_config(
        "more.yaml", train={"total_steps": 6, "steps_per_node": 2}, checkpoint={"resume": True}
    )
    second = _pyflyte(more, workdir)
    assert second.returncode == 0, second.stdout + second.stderr
    state2 = read_state(find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "t"))
    assert state2["run_id"] == state["run_id"] and state2["policy_version"] == 6
    history = client.get_metric_history(run.info.run_id, "train/reward_mean")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5, 6]


def test_bad_config_fails_before_any_work(small_config, workdir):
    cfg = small_config(
        "bad.yaml", reward={"name": "no_such_reward"}, data={"eval_path": "nope.jsonl"}
    )
    out = _pyflyte(cfg, workdir)
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "reward.name" in text and "no_such_reward" in text
    assert "data.eval_path" in text and "nope.jsonl" in text
    assert not (workdir / ".relax").exists(), "work started before the config was checked"


def test_unknown_field_is_refused_by_pyflyte_itself(small_config, workdir):
    cfg = small_config("typo.yaml", train={"total_stepz": 3})
    out = _pyflyte(cfg, workdir)
    assert out.returncode != 0
    assert "train.total_stepz: unknown field" in out.stdout + out.stderr
    assert not (workdir / ".relax").exists()


def test_pyflyte_run_async_mode_runs_the_roles_as_supervised_processes(small_config, workdir):
    cfg = small_config(
        "async.yaml",
        mode="async",
        rollout={"max_staleness": 1},
        algorithm={"proximal": "behaviour"},
        train={"total_steps": 4, "checkpoint_every": 2},
    )
    out = _pyflyte(cfg, workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Run summary" in out.stderr
    ckpt = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "t")
    state = read_state(ckpt)
    assert state["policy_version"] == 4
    logs = sorted(os.listdir(os.path.join(os.path.dirname(ckpt), "logs")))
    assert logs == ["advantages-0.log", "rollout-0.log", "trainer-0.log"]
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    run = client.get_run(state["tracking_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["relax.mode"] == "async"
    staleness = client.get_metric_history(run.info.run_id, "train/staleness_max")
    assert [m.step for m in sorted(staleness, key=lambda m: m.step)] == [1, 2, 3, 4]
    assert max(m.value for m in staleness) <= 1
