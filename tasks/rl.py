"""Flyte tasks for a run (flytekit): the bodies of tasks/bodies.py, decorated.

Each task takes the run config plus a checkpoint path and returns one, so the console shows every
node, a failed node is retried from the last checkpoint, and the policy preparation is cached.
flyte2/train.py decorates the same bodies for Flyte 2.

Only the first task takes the `RunConfig` dataclass (what `pyflyte run ... --cfg x.yaml` fills);
it hands the others the validated config as canonical JSON text. flytekit rebuilds a nested
dataclass's literal type for every task interface (0.6-1.3 s each on 2 cores), which made a third of
a CPU run's wall time; a string costs nothing. The interfaces that do name `RunConfig` (this
task, the `train` and `evaluate` workflows) share one build of its literal type
(tasks/flyte_types.py).

Resources, timeouts and retries are what a cluster schedules (local execution ignores them),
decided from the run config by relax_core/ops/asks.py: the decorators carry the registration
config's ($RELAX_CONFIG, else the default: CPU only), and workflows/train.py's @dynamic nodes give
the tasks they start the run's own. rl_steps is interruptible (spot capacity): a preempted node
restarts from the newest checkpoint it or an earlier attempt saved. prepare_policy's Flyte cache
is versioned by the source of the code that prepares policies (relax_core/run/policy_code.py).
"""

from __future__ import annotations

import os

from flytekit import task
from flytekit.deck import DeckField

from relax_core.config import RunConfig
from relax_core.run.policy_code import policy_code_version
from tasks import bodies
from tasks.bodies import Prepared, RunSummary, execution_of  # noqa: F401 - re-exported
from tasks.flyte_types import register_cached_type, register_run_config
from tasks.resources import registered

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
register_run_config()
register_cached_type(RunSummary)


@task(**registered("prepare_data"))
def prepare_data(cfg: RunConfig) -> Prepared:
    """Validate everything a run needs before any work starts, its GPUs' memory included (the
    memory plan for services.accelerator, printed; a run that does not fit fails here, its
    message the plan with each problem); returns the config as JSON and the data fingerprint."""
    return bodies.prepare_data(cfg)


@task(**registered("prepare_policy"), cache=True, cache_version=policy_code_version())
def prepare_policy(spec_json: str, cache_dir: str, storage_json: str) -> str:
    """The starting policy: tiny model + supervised warm start, or a converted pretrained model.

    Cached on exactly the settings that determine it, so runs that differ only in RL settings
    share one warm start.
    """
    return bodies.prepare_policy(spec_json, cache_dir, storage_json)


@task(**registered("policy_spec"))
def policy_spec(cfg_json: str, data_fingerprint: str) -> str:
    """The settings that determine the starting weights, as canonical JSON (the cache key); a
    registry source is pinned to the version it names now."""
    return bodies.policy_spec(cfg_json, data_fingerprint)


@task(**registered("start_run"))
def start_run(cfg_json: str, policy_dir: str) -> str:
    """New run: held-out eval at step 0 and checkpoint v0. Resume: the checkpoint to continue."""
    return bodies.start_run(cfg_json, policy_dir)


@task(**registered("rl_steps"))
def rl_steps(cfg_json: str, checkpoint: str) -> str:
    """Up to `train.steps_per_node` RL steps from `checkpoint`; returns the newest checkpoint.

    A retry restarts from the checkpoint it was given plus whatever the failed attempt saved.
    """
    return bodies.rl_steps(cfg_json, checkpoint)


@task(**registered("async_local"))
def async_local(cfg_json: str, checkpoint: str) -> str:
    """Async mode on one machine: every role as a supervised OS process; returns the final
    checkpoint. (flytekit's local execution runs nodes one after another, so role tasks could
    not run side by side there.)"""
    return bodies.async_local(cfg_json, checkpoint)


@task(**registered("trainer_service"))
def trainer_service(cfg_json: str, checkpoint: str) -> str:
    """Async mode on a cluster: the trainer role; returns the final checkpoint. A retry
    resumes from the newest checkpoint with the exact `ready` position."""
    return bodies.trainer_service(cfg_json, checkpoint)


@task(**registered("rollout_service"))
def rollout_service(cfg_json: str, checkpoint: str, worker: int) -> None:
    """Async mode on a cluster: one rollout worker (engine + rewards); interruptible, since
    admission tickets and queue commits make a restarted worker lose and repeat nothing."""
    bodies.serve("rollout", cfg_json, checkpoint, worker)


@task(**registered("sglang_rollout_service"))
def sglang_rollout_service(cfg_json: str, checkpoint: str, worker: int) -> None:
    """Async mode on a cluster with `rollout.engine: sglang`: one rollout worker driving the
    SGLang server in its pod's sidecar (tasks/pods.py); the GPU belongs to the sidecar."""
    bodies.serve("rollout", cfg_json, checkpoint, worker)


@task(**registered("reference_service"))
def reference_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: frozen reference / teacher log-probs."""
    bodies.serve("reference", cfg_json, checkpoint)


@task(**registered("actor_fwd_service"))
def actor_fwd_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: proximal log-probs under the newest trainer weights."""
    bodies.serve("actor_fwd", cfg_json, checkpoint)


@task(**registered("advantages_service"))
def advantages_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: group-normalized advantages (CPU only)."""
    bodies.serve("advantages", cfg_json, checkpoint)


@task(
    **registered("finish_run"),
    enable_deck=True,
    # Not flytekit's Dependencies page: `pip list` in a subprocess, 1.2 s at the end of every
    # run, for what the registered model's requirements already record; nor this task's source.
    deck_fields=(DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT),
)
def finish_run(cfg_json: str, checkpoint: str) -> RunSummary:
    """Final held-out eval, close the MLflow run, print the summary; the run report (curves,
    staleness histogram, time per role, MLflow link) is this task's Flyte Deck."""
    from flytekit import Deck

    summary = bodies.finish_run(cfg_json, checkpoint)
    Deck("Run report", bodies.run_report_page(cfg_json, summary.mlflow_run_id))
    return summary
