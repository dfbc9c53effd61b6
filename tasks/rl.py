"""Flyte tasks for a colocate RL run: thin wrappers over relax_core.services.run.

Each task takes the run config plus a checkpoint path and returns one, so the console shows every
node, a failed node is retried from the last checkpoint, and the policy preparation is cached.
Resources here are the CPU default's; GPU requests come with the cluster graph.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flytekit import Resources, task

from relax_core.config import RunConfig
from relax_core.models import policy
from relax_core.models.policy import PolicySpec

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

CPU = Resources(cpu="2", mem="8Gi")


@dataclass
class RunSummary:
    run_id: str
    steps: int
    eval_accuracy_before: float
    eval_accuracy_after: float
    wall_time_s: float
    mlflow_run_id: str
    checkpoint: str


@task(requests=CPU)
def prepare_data(cfg: RunConfig) -> str:
    """Validate everything a run needs before any work starts; returns the train data fingerprint."""
    from relax_core.data.dataset import fingerprint
    from relax_core.services.run import preflight

    preflight(cfg)
    return fingerprint(cfg.data.train_path)


@task(requests=CPU, cache=True, cache_version="1")
def prepare_policy(spec: PolicySpec, cache_dir: str) -> str:
    """The starting policy: tiny model + supervised warm start, or a converted pretrained model.

    Cached on exactly the settings that determine it, so runs that differ only in RL settings
    share one warm start.
    """
    return policy.prepare_policy(spec, cache_dir)


@task(requests=CPU)
def policy_spec(cfg: RunConfig, data_fingerprint: str) -> PolicySpec:
    return PolicySpec.of(cfg, data_fingerprint)


@task(requests=CPU)
def start_run(cfg: RunConfig, policy_dir: str) -> str:
    """New run: held-out eval at step 0 and checkpoint v0. Resume: the checkpoint to continue."""
    from relax_core.services import run

    return run.start_run(cfg, policy_dir)


@task(requests=CPU, retries=2)
def rl_steps(cfg: RunConfig, checkpoint: str) -> str:
    """Up to `train.steps_per_node` RL steps from `checkpoint`; returns the newest checkpoint.

    A retry restarts from the checkpoint it was given plus whatever the failed attempt saved.
    """
    from relax_core.services import run

    return run.run_steps(cfg, run.newest_checkpoint(checkpoint), cfg.train.steps_per_node)


@task(requests=CPU)
def finish_run(cfg: RunConfig, checkpoint: str) -> RunSummary:
    """Final held-out eval, close the MLflow run, print the summary."""
    from relax_core.services import run

    s = run.finish_run(cfg, checkpoint)
    return RunSummary(
        run_id=s["run_id"],
        steps=s["steps"],
        eval_accuracy_before=s["eval_accuracy_before"],
        eval_accuracy_after=s["eval_accuracy_after"],
        wall_time_s=s["wall_time_s"],
        mlflow_run_id=s["mlflow_run_id"],
        checkpoint=s["checkpoint"],
    )
