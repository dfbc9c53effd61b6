"""`pyflyte run workflows/evaluate.py evaluate` on a trained checkpoint: the same accuracy the
training run's final eval logged, pass@k, and an MLflow run nested under the training run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from relax_core.config import config_to_dict, load_config, replace
from relax_core.services.evaluate_checkpoint import pass_at_k
from relax_core.services.run import run

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pass_at_k_estimator_by_hand():
    # n 4, c 1, k 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5; c 0 -> 0; n - c < k -> 1
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert math.isclose(pass_at_k(8, 2, 1), 0.25)  # pass@1 is the plain success rate
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


def test_evaluate_reports_the_training_runs_final_accuracy(workdir):
    # The CPU default's warm-started policy (right about a fifth of the time), 2 RL steps: an
    # accuracy far from 0 and 1, so agreeing on it means something.
    cfg = replace(
        load_config(os.path.join(REPO, "configs", "cpu-default.yaml")),
        data={"eval_size": 64},
        train={"total_steps": 2, "steps_per_node": 2, "eval_every": 0, "torch_threads": 2},
        tracking={"tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}", "progress": False},
    )
    cfg_path = str(workdir / "cfg.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f)
    summary = run(cfg)
    assert 0.05 < summary["eval_accuracy_after"] < 0.95
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "pyflyte"),
        "run",
        os.path.join(REPO, "workflows", "evaluate.py"),
        "evaluate",
        "--cfg",
        cfg_path,
        "--checkpoint",
        summary["checkpoint"],
        "--k",
        "4",
        "--samples",
        "4",
    ]
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"pass@1 {summary['eval_accuracy_after']:.3f}" in out.stdout + out.stderr

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    evals = client.search_runs(
        [r.experiment_id for r in client.search_experiments()],
        filter_string="tags.`relax.kind` = 'evaluation'",
    )
    assert len(evals) == 1
    ev = evals[0]
    # Same greedy evaluation as the training run's end, on the same weights: the same number.
    assert ev.data.metrics["eval/accuracy"] == summary["eval_accuracy_after"]
    assert 0.0 <= ev.data.metrics["eval/pass_at_4"] <= 1.0
    assert ev.data.metrics["eval/pass_at_4"] >= ev.data.metrics["eval/sampled_accuracy"]
    assert ev.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
    assert ev.data.params["checkpoint"] == summary["checkpoint"]
    with open(os.path.join(os.path.dirname(summary["checkpoint"]), "summary.json")) as f:
        logged = json.load(f)["eval_after"]["eval/accuracy"]
    assert logged == summary["eval_accuracy_after"]
