"""Flyte tasks for a colocate RL run: thin wrappers over relax_core.services.run.

Each task takes the run config plus a checkpoint path and returns one, so the console shows every
node, a failed node is retried from the last checkpoint, and the policy preparation is cached.

Resources are what a cluster schedules (local execution ignores them): light tasks get a small
CPU pod; the tasks that hold the model get a GPU. rl_steps is interruptible (spot capacity): a
preempted node restarts from the newest checkpoint it or an earlier attempt saved.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from flytekit import Resources, task
from flytekit.extras.accelerators import H100

from relax_core.config import RunConfig
from relax_core.models import policy
from relax_core.models.policy import PolicySpec

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

CPU = Resources(cpu="2", mem="8Gi")
GPU = Resources(cpu="8", mem="64Gi", gpu="1")
GPU_LIMITS = Resources(cpu="16", mem="96Gi", gpu="1")


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


@task(
    requests=GPU,
    limits=GPU_LIMITS,
    accelerator=H100,
    cache=True,
    cache_version="1",
    retries=1,
    timeout=timedelta(hours=2),
)
def prepare_policy(spec: PolicySpec, cache_dir: str) -> str:
    """The starting policy: tiny model + supervised warm start, or a converted pretrained model.

    Cached on exactly the settings that determine it, so runs that differ only in RL settings
    share one warm start.
    """
    return policy.prepare_policy(spec, cache_dir)


@task(requests=CPU)
def policy_spec(cfg: RunConfig, data_fingerprint: str) -> PolicySpec:
    return PolicySpec.of(cfg, data_fingerprint)


@task(requests=GPU, limits=GPU_LIMITS, accelerator=H100, retries=1, timeout=timedelta(hours=1))
def start_run(cfg: RunConfig, policy_dir: str) -> str:
    """New run: held-out eval at step 0 and checkpoint v0. Resume: the checkpoint to continue."""
    from relax_core.services import run

    return run.start_run(cfg, policy_dir)


@task(
    requests=GPU,
    limits=GPU_LIMITS,
    accelerator=H100,
    retries=3,
    interruptible=True,
    timeout=timedelta(hours=6),
)
def rl_steps(cfg: RunConfig, checkpoint: str) -> str:
    """Up to `train.steps_per_node` RL steps from `checkpoint`; returns the newest checkpoint.

    A retry restarts from the checkpoint it was given plus whatever the failed attempt saved.
    """
    from relax_core.services import run

    return run.run_steps(cfg, run.newest_checkpoint(checkpoint), cfg.train.steps_per_node)


@task(requests=GPU, limits=GPU_LIMITS, accelerator=H100, retries=1, timeout=timedelta(hours=1))
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
