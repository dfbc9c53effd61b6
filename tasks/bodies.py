"""What each task of a run does, as plain functions: the one code path both entry points call.

tasks/rl.py decorates these with flytekit (`pyflyte run workflows/train.py ...`), flyte2/train.py
with Flyte 2 (`flyte run flyte2/train.py ...`); each SDK only adds its interface, its resource
asks and its report. No Flyte SDK is imported here, so a body runs the same under either.

Every body but prepare_data takes the validated config as canonical JSON text (cfg_json): a
string crosses either SDK's type system for nothing, where the nested `RunConfig` dataclass costs
flytekit a schema build per interface. The heavy imports (torch, the engines) stay inside the
bodies, so loading a workflow module to build the graph stays light.
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
from dataclasses import dataclass
from typing import NamedTuple

from relax_core.config import RunConfig, config_to_dict
from relax_core.config.sections import StorageConfig
from relax_core.run import prepare
from relax_core.storage import parent, where


@dataclass
class RunSummary:
    run_id: str
    steps: int
    eval_accuracy_before: float
    eval_accuracy_after: float
    wall_time_s: float
    mlflow_run_id: str
    checkpoint: str


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


def trained(cfg: RunConfig, checkpoint: str) -> int:
    """The steps the run of `checkpoint` has trained (read from the run's storage)."""
    from relax_core.train.checkpoint import read_state

    return int(read_state(checkpoint, cfg.storage.options())["policy_version"])


def config_of(cfg_json: str) -> RunConfig:
    return RunConfig.from_json(cfg_json)


def prepare_data(cfg: RunConfig) -> Prepared:
    """Validate everything a run needs before any work starts, its GPUs' memory included (the
    memory plan for services.accelerator, printed; a run that does not fit fails here, its
    message the plan with each problem); returns the config as JSON and the data fingerprint."""
    from relax_core.data.dataset import fingerprint
    from relax_core.heap import freeze_heap
    from relax_core.plan.memory import plan_gpu
    from relax_core.plan.report import check_memory, render
    from relax_core.run.lifecycle import preflight

    freeze_heap()  # the SDK, the workflow's modules and the config: the task process keeps them
    preflight(cfg)
    print(render(check_memory(cfg, plan_gpu(cfg))), flush=True)
    return Prepared(
        cfg_json=json.dumps(config_to_dict(cfg), sort_keys=True),
        data_fingerprint=fingerprint(cfg.data.train_path),
        policy_cache=where(cfg.checkpoint.policy_cache_dir),
        storage_json=json.dumps(dataclasses.asdict(cfg.storage), sort_keys=True),
        execution=execution_of(cfg),
    )


def prepare_policy(spec_json: str, cache_dir: str, storage_json: str) -> str:
    """The starting policy: tiny model + supervised warm start, or a converted pretrained model,
    kept in `cache_dir` under exactly the settings that determine it."""
    storage = StorageConfig(**json.loads(storage_json))
    spec = prepare.PolicySpec.from_json(spec_json)
    return prepare.prepare_policy(spec, cache_dir, storage.options(), storage.scratch_dir)


def policy_spec(cfg_json: str, data_fingerprint: str) -> str:
    """The settings that determine the starting weights, as canonical JSON (the cache key); a
    registry source is pinned to the version it names now."""
    from relax_core.run.lifecycle import policy_spec_for

    return policy_spec_for(config_of(cfg_json), data_fingerprint).to_json()


def start_run(cfg_json: str, policy_dir: str) -> str:
    """New run: held-out eval at step 0 and checkpoint v0. Resume: the checkpoint to continue."""
    from relax_core.run import lifecycle

    return lifecycle.start_run(config_of(cfg_json), policy_dir)


def rl_steps(cfg_json: str, checkpoint: str) -> str:
    """Up to `train.steps_per_node` RL steps from `checkpoint`; returns the newest checkpoint.
    A retry restarts from the checkpoint it was given plus whatever the failed attempt saved."""
    from relax_core.run import lifecycle

    cfg = config_of(cfg_json)
    fallback = cfg.checkpoint.fallback_to_previous
    start = lifecycle.newest_checkpoint(checkpoint, cfg.storage.options(), fallback)
    return lifecycle.run_steps(cfg, start, cfg.train.steps_per_node)


def async_local(cfg_json: str, checkpoint: str) -> str:
    """Async mode on one machine: every role as a supervised OS process; returns the final
    checkpoint."""
    from relax_core.ops.supervisor import run_async_local
    from relax_core.run import lifecycle

    cfg = config_of(cfg_json)
    fallback = cfg.checkpoint.fallback_to_previous
    return run_async_local(
        cfg, lifecycle.newest_checkpoint(checkpoint, cfg.storage.options(), fallback)
    )


def serve(role: str, cfg_json: str, checkpoint: str, worker: int = 0) -> None:
    """Async mode on a cluster: one role (not the trainer) until the run ends."""
    from relax_core.roles.service import run_role
    from relax_core.run.role_services import serve_fn
    from relax_core.train.checkpoint import read_state

    cfg = config_of(cfg_json)
    run_id = read_state(checkpoint, cfg.storage.options())["run_id"]
    run_role(role, serve_fn(role), cfg, run_id, checkpoint, worker)


def _serve_ranks(cfg_json: str, checkpoint: str) -> None:
    """The trainer over the pod's GPUs: torchrun, one process per GPU (train/ranks.py)."""
    import subprocess

    from relax_core.ops.processes import role_launcher
    from relax_core.train.checkpoint import read_state

    cfg = config_of(cfg_json)
    cmd = [*role_launcher(cfg, "trainer"), "--cfg", cfg_json]
    cmd += ["--run-id", read_state(checkpoint, cfg.storage.options())["run_id"]]
    cmd += ["--checkpoint", checkpoint]
    subprocess.run(cmd, check=True)


def trainer_service(cfg_json: str, checkpoint: str) -> str:
    """Async mode on a cluster: the trainer role; returns the final checkpoint. A retry resumes
    from the newest checkpoint with the exact `ready` position."""
    from relax_core.run import lifecycle
    from relax_core.train.checkpoint import list_checkpoints

    cfg = config_of(cfg_json)
    options = cfg.storage.options()
    start = lifecycle.newest_checkpoint(checkpoint, options, cfg.checkpoint.fallback_to_previous)
    if cfg.services.trainer_gpus > 1:
        _serve_ranks(cfg_json, start)
    else:
        serve("trainer", cfg_json, start)
    return list_checkpoints(parent(start), options)[-1]


def finish_run(cfg_json: str, checkpoint: str) -> RunSummary:
    """Final held-out eval, close the MLflow run (registering the policy), print the summary."""
    from relax_core.run import lifecycle

    s = lifecycle.finish_run(config_of(cfg_json), checkpoint)
    return RunSummary(**{f.name: s[f.name] for f in dataclasses.fields(RunSummary)})


def run_report_page(cfg_json: str, mlflow_run_id: str) -> str:
    """The run report (curves, staleness histogram, time per role, MLflow link) as an HTML
    page; a report that cannot be built costs the page, not the run."""
    from relax_core.tracking.store import default_tracking_uri

    cfg = config_of(cfg_json)
    try:
        from relax_core.tracking.report import run_report_html

        return run_report_html(cfg.tracking.tracking_uri or default_tracking_uri(), mlflow_run_id)
    except Exception as exc:  # noqa: BLE001 - reported in the page and the log instead
        logging.getLogger(__name__).warning("run report failed: %s", exc)
        return f"<p>The run report could not be built: {html.escape(repr(exc))}</p>"
