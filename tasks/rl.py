"""Flyte tasks for a colocate RL run: thin wrappers over relax_core.run.lifecycle.

Each task takes the run config plus a checkpoint path and returns one, so the console shows every
node, a failed node is retried from the last checkpoint, and the policy preparation is cached.

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

import dataclasses
import html
import json
import logging
import os
from dataclasses import dataclass
from typing import NamedTuple

from flytekit import task
from flytekit.deck import DeckField

from relax_core.config import RunConfig, config_to_dict
from relax_core.config.sections import StorageConfig
from relax_core.run import prepare
from relax_core.run.policy_code import policy_code_version
from relax_core.storage import parent, where
from tasks.flyte_types import register_cached_type, register_run_config
from tasks.resources import registered

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
register_run_config()


@dataclass
class RunSummary:
    run_id: str
    steps: int
    eval_accuracy_before: float
    eval_accuracy_after: float
    wall_time_s: float
    mlflow_run_id: str
    checkpoint: str


register_cached_type(RunSummary)


class Prepared(NamedTuple):
    cfg_json: str
    data_fingerprint: str
    policy_cache: str
    """Where prepared policies are cached (checkpoint.policy_cache_dir, resolved)."""
    storage_json: str
    """The storage section as JSON: how prepare_policy reaches the cache."""
    execution: str
    """How the steps run: 'colocate', 'async-processes' (one task supervising local role
    processes) or 'async-tasks' (one task per role, in parallel on a cluster)."""


def execution_of(cfg: RunConfig) -> str:
    return "colocate" if cfg.mode == "colocate" else f"async-{cfg.services.launch}"


def _cfg(cfg_json: str) -> RunConfig:
    return RunConfig.from_json(cfg_json)


@task(**registered("prepare_data"))
def prepare_data(cfg: RunConfig) -> Prepared:
    """Validate everything a run needs before any work starts, its GPUs' memory included (the
    memory plan for services.accelerator, printed; a run that does not fit fails here, its
    message the plan with each problem); returns the config as JSON and the data fingerprint."""
    from relax_core.data.dataset import fingerprint
    from relax_core.heap import freeze_heap
    from relax_core.plan.memory import plan_gpu
    from relax_core.plan.report import check_memory, render
    from relax_core.run.lifecycle import preflight

    freeze_heap()  # flytekit, the workflow's modules and the config: the task process keeps them
    preflight(cfg)
    print(render(check_memory(cfg, plan_gpu(cfg))), flush=True)
    cfg_json = json.dumps(config_to_dict(cfg), sort_keys=True)
    return Prepared(
        cfg_json=cfg_json,
        data_fingerprint=fingerprint(cfg.data.train_path),
        policy_cache=where(cfg.checkpoint.policy_cache_dir),
        storage_json=json.dumps(dataclasses.asdict(cfg.storage), sort_keys=True),
        execution=execution_of(cfg),
    )


@task(**registered("prepare_policy"), cache=True, cache_version=policy_code_version())
def prepare_policy(spec_json: str, cache_dir: str, storage_json: str) -> str:
    """The starting policy: tiny model + supervised warm start, or a converted pretrained model.

    Cached on exactly the settings that determine it, so runs that differ only in RL settings
    share one warm start.
    """
    storage = StorageConfig(**json.loads(storage_json))
    spec = prepare.PolicySpec.from_json(spec_json)
    return prepare.prepare_policy(spec, cache_dir, storage.options(), storage.scratch_dir)


@task(**registered("policy_spec"))
def policy_spec(cfg_json: str, data_fingerprint: str) -> str:
    """The settings that determine the starting weights, as canonical JSON (the cache key); a
    registry source is pinned to the version it names now."""
    from relax_core.run.lifecycle import policy_spec_for

    return policy_spec_for(_cfg(cfg_json), data_fingerprint).to_json()


@task(**registered("start_run"))
def start_run(cfg_json: str, policy_dir: str) -> str:
    """New run: held-out eval at step 0 and checkpoint v0. Resume: the checkpoint to continue."""
    from relax_core.run import lifecycle

    return lifecycle.start_run(_cfg(cfg_json), policy_dir)


@task(**registered("rl_steps"))
def rl_steps(cfg_json: str, checkpoint: str) -> str:
    """Up to `train.steps_per_node` RL steps from `checkpoint`; returns the newest checkpoint.

    A retry restarts from the checkpoint it was given plus whatever the failed attempt saved.
    """
    from relax_core.run import lifecycle

    cfg = _cfg(cfg_json)
    fallback = cfg.checkpoint.fallback_to_previous
    start = lifecycle.newest_checkpoint(checkpoint, cfg.storage.options(), fallback)
    return lifecycle.run_steps(cfg, start, cfg.train.steps_per_node)


@task(**registered("async_local"))
def async_local(cfg_json: str, checkpoint: str) -> str:
    """Async mode on one machine: every role as a supervised OS process; returns the final
    checkpoint. (flytekit's local execution runs nodes one after another, so role tasks could
    not run side by side there.)"""
    from relax_core.ops.supervisor import run_async_local
    from relax_core.run import lifecycle

    cfg = _cfg(cfg_json)
    fallback = cfg.checkpoint.fallback_to_previous
    return run_async_local(
        cfg, lifecycle.newest_checkpoint(checkpoint, cfg.storage.options(), fallback)
    )


def _serve(role: str, cfg_json: str, checkpoint: str, worker: int = 0) -> None:
    from relax_core.roles.service import run_role
    from relax_core.run.role_services import serve_fn
    from relax_core.train.checkpoint import read_state

    cfg = _cfg(cfg_json)
    run_id = read_state(checkpoint, cfg.storage.options())["run_id"]
    run_role(role, serve_fn(role), cfg, run_id, checkpoint, worker)


def _serve_ranks(cfg_json: str, checkpoint: str) -> None:
    """The trainer over the pod's GPUs: torchrun, one process per GPU (train/ranks.py)."""
    import subprocess

    from relax_core.ops.processes import role_launcher
    from relax_core.train.checkpoint import read_state

    cfg = _cfg(cfg_json)
    cmd = [*role_launcher(cfg, "trainer"), "--cfg", cfg_json]
    cmd += ["--run-id", read_state(checkpoint, cfg.storage.options())["run_id"]]
    cmd += ["--checkpoint", checkpoint]
    subprocess.run(cmd, check=True)


@task(**registered("trainer_service"))
def trainer_service(cfg_json: str, checkpoint: str) -> str:
    """Async mode on a cluster: the trainer role; returns the final checkpoint. A retry
    resumes from the newest checkpoint with the exact `ready` position."""
    from relax_core.run import lifecycle
    from relax_core.train.checkpoint import list_checkpoints

    cfg = _cfg(cfg_json)
    options = cfg.storage.options()
    start = lifecycle.newest_checkpoint(checkpoint, options, cfg.checkpoint.fallback_to_previous)
    if cfg.services.trainer_gpus > 1:
        _serve_ranks(cfg_json, start)
    else:
        _serve("trainer", cfg_json, start)
    return list_checkpoints(parent(start), options)[-1]


@task(**registered("rollout_service"))
def rollout_service(cfg_json: str, checkpoint: str, worker: int) -> None:
    """Async mode on a cluster: one rollout worker (engine + rewards); interruptible, since
    admission tickets and queue commits make a restarted worker lose and repeat nothing."""
    _serve("rollout", cfg_json, checkpoint, worker)


@task(**registered("sglang_rollout_service"))
def sglang_rollout_service(cfg_json: str, checkpoint: str, worker: int) -> None:
    """Async mode on a cluster with `rollout.engine: sglang`: one rollout worker driving the
    SGLang server in its pod's sidecar (tasks/pods.py); the GPU belongs to the sidecar."""
    _serve("rollout", cfg_json, checkpoint, worker)


@task(**registered("reference_service"))
def reference_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: frozen reference / teacher log-probs."""
    _serve("reference", cfg_json, checkpoint)


@task(**registered("actor_fwd_service"))
def actor_fwd_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: proximal log-probs under the newest trainer weights."""
    _serve("actor_fwd", cfg_json, checkpoint)


@task(**registered("advantages_service"))
def advantages_service(cfg_json: str, checkpoint: str) -> None:
    """Async mode on a cluster: group-normalized advantages (CPU only)."""
    _serve("advantages", cfg_json, checkpoint)


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
    from relax_core.run import lifecycle

    cfg = _cfg(cfg_json)
    s = lifecycle.finish_run(cfg, checkpoint)
    _run_report_deck(cfg, s["mlflow_run_id"])
    return RunSummary(
        run_id=s["run_id"],
        steps=s["steps"],
        eval_accuracy_before=s["eval_accuracy_before"],
        eval_accuracy_after=s["eval_accuracy_after"],
        wall_time_s=s["wall_time_s"],
        mlflow_run_id=s["mlflow_run_id"],
        checkpoint=s["checkpoint"],
    )


def _run_report_deck(cfg: RunConfig, mlflow_run_id: str) -> None:
    """The report as a Deck; a report that cannot be built costs the deck, not the run."""
    from flytekit import Deck

    from relax_core.tracking.store import default_tracking_uri

    try:
        from relax_core.tracking.report import run_report_html

        page = run_report_html(cfg.tracking.tracking_uri or default_tracking_uri(), mlflow_run_id)
    except Exception as exc:  # noqa: BLE001 - reported in the deck and the log instead
        logging.getLogger(__name__).warning("run report failed: %s", exc)
        page = f"<p>The run report could not be built: {html.escape(repr(exc))}</p>"
    Deck("Run report", page)
