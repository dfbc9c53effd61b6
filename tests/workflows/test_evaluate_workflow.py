"""`pyflyte run workflows/evaluate.py evaluate` on a trained checkpoint: the same accuracy the
training run's final eval logged, pass@k, and an MLflow run nested under the training run. The
run's final policy is a registered MLflow model: evaluating it, serving it as a pyfunc and
starting a new run from it all see the very same weights."""

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
from relax_core.run.evaluate import pass_at_k
from relax_core.run.lifecycle import run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pass_at_k_estimator_by_hand():
    # n 4, c 1, k 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6 = 0.5; c 0 -> 0; n - c < k -> 1
    assert pass_at_k(4, 1, 2) == 0.5
    assert pass_at_k(4, 0, 2) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    assert math.isclose(pass_at_k(8, 2, 1), 0.25)  # pass@1 is the plain success rate
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 5)


@pytest.mark.slow
def test_evaluate_reports_the_training_runs_final_accuracy(workdir, cpu_default_policies):
    # The CPU default's warm-started policy (right about a fifth of the time), 2 RL steps: an
    # accuracy far from 0 and 1, so agreeing on it means something.
    cfg = replace(
        load_config(os.path.join(REPO, "configs", "cpu-default.yaml")),
        data={"eval_size": 64},
        train={"total_steps": 2, "steps_per_node": 2, "eval_every": 0, "torch_threads": 2},
        checkpoint={"policy_cache_dir": cpu_default_policies[0]},  # the shared warm start
        tracking={
            "tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}",
            "progress": False,
            "registered_model": "relax-test-policy",
        },
    )
    cfg_path = str(workdir / "cfg.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f)
    summary = run(cfg)
    assert 0.05 < summary["eval_accuracy_after"] < 0.95
    assert summary["registered_model"] == "models:/relax-test-policy/1"
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
    _check_registered_policy(cfg, summary, workdir)


def _check_registered_policy(cfg, first, workdir):
    """Evaluating, serving and starting a run from the registered version all see the final
    checkpoint's weights."""
    import mlflow

    from relax_core.rewards.registry import build_reward
    from relax_core.rewards.scoring import score_batch
    from relax_core.run.evaluate import evaluate_checkpoint

    uri = cfg.tracking.tracking_uri
    original = mlflow.get_tracking_uri()
    client = MlflowClient(uri)
    version = client.get_model_version("relax-test-policy", "1")
    assert version.run_id == first["mlflow_run_id"]
    assert version.tags["relax.policy_version"] == str(first["steps"])
    assert float(version.tags["relax.eval_accuracy"]) == round(first["eval_accuracy_after"], 4)

    # Evaluating the registered version is evaluating the final checkpoint, whatever MLflow
    # URI the process had set before (the config's store is the one read).
    mlflow.set_tracking_uri(f"sqlite:///{workdir / 'elsewhere.db'}")
    ev = evaluate_checkpoint(cfg, "", k=2, n_samples=2, model="models:/relax-test-policy/latest")
    assert ev["eval_accuracy"] == first["eval_accuracy_after"]
    assert (
        ev["checkpoint"] == "models:/relax-test-policy/1"
    )  # 'latest' pinned to the version it used
    assert ev["training_mlflow_run_id"] == first["mlflow_run_id"]

    # Served as a pyfunc, the model answers the eval prompts as well as the run said it does.
    with open(cfg.data.eval_path) as f:
        rows = [json.loads(line) for line in f][: cfg.data.eval_size]
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        served = mlflow.pyfunc.load_model("models:/relax-test-policy/1")
    finally:
        mlflow.set_tracking_uri(previous)
    texts = served.predict([r["prompt"] for r in rows])
    reward = build_reward(cfg.reward, cache_dir=str(workdir / "hf"), dtype="float32", seed=0)
    results, _ = score_batch(reward, texts, [r["answer"] for r in rows], rows)
    assert sum(r.correct for r in results) / len(rows) == first["eval_accuracy_after"]

    # A run that starts from the registry (what the nightly launch plan does) starts from exactly
    # those weights: its step-0 eval is the first run's final eval.
    seeded = replace(
        cfg,
        run_name="from-registry",
        model={"kind": "pretrained", "source": "models:/relax-test-policy/latest"},
        warm_start={"steps": 0},
        checkpoint={"policy_cache_dir": str(workdir / "policies")},
    )
    second = run(seeded)
    assert second["eval_accuracy_before"] == first["eval_accuracy_after"]
    assert second["registered_model"] == "models:/relax-test-policy/2"
    # Its summary links the MLflow UI page comparing it with the experiment's previous run.
    assert first["mlflow_run_id"] in second["compare_url"]
    assert second["mlflow_run_id"] in second["compare_url"]
    assert second["compare_url"].startswith("http://127.0.0.1:5000/#/compare-runs?runs=")
    with pytest.raises(ValueError, match="no registered model 'nope'"):
        evaluate_checkpoint(cfg, model="models:/nope/latest")
    with pytest.raises(ValueError, match="exactly one of --checkpoint"):
        evaluate_checkpoint(cfg, first["checkpoint"], model="models:/relax-test-policy/1")
    mlflow.set_tracking_uri(original)
