"""Flyte task for evaluating a checkpoint: a thin wrapper over relax_core.run.evaluate."""

from __future__ import annotations

import os
from dataclasses import dataclass

from flytekit import task

from relax_core.config import RunConfig
from tasks.flyte_types import register_cached_type, register_run_config
from tasks.resources import registered

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
register_run_config()


@dataclass
class EvalSummary:
    checkpoint: str
    policy_version: int
    eval_accuracy: float
    pass_at_k: float
    k: int
    reward_mean: float
    mlflow_run_id: str
    training_mlflow_run_id: str


register_cached_type(EvalSummary)


@task(**registered("evaluate_checkpoint"))
def evaluate_checkpoint(
    cfg: RunConfig, checkpoint: str, model: str, k: int, samples: int
) -> EvalSummary:
    """Greedy pass@1, sampled pass@k and mean reward on cfg's eval split of a checkpoint
    directory or a registered model version (exactly one of the two)."""
    from relax_core.run.evaluate import evaluate_checkpoint as run_eval

    result = run_eval(cfg, checkpoint, k=k, n_samples=samples, model=model)
    print(
        f"eval of {result['checkpoint']} (v{result['policy_version']}): "
        f"pass@1 {result['eval_accuracy']:.3f}, pass@{k} {result['pass_at_k']:.3f}, "
        f"mean reward {result['reward_mean']:.3f}; MLflow run {result['mlflow_run_id']} "
        f"(under training run {result['training_mlflow_run_id']})",
        flush=True,
    )
    return EvalSummary(**result)
