"""Run lifecycle: preflight -> start (eval at step 0) -> steps -> finish.

Colocate: `run_steps` trains in this process. Async: the steps are the role services
(supervisor.py locally; parallel Flyte tasks on a cluster); start and finish are shared.

These are the functions the Flyte tasks call (one per node) and the `python -m
relax_core.run.lifecycle` CLI calls in one process. Each takes the config and a checkpoint path and
returns a checkpoint path, so any node can be rerun or resumed from what the last one left.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from relax_core.config import ConfigError, RunConfig
from relax_core.heap import freeze_heap
from relax_core.run.colocate import ColocateController
from relax_core.run.prepare import MARKER, local_policy
from relax_core.run.session import RunSession, RunState
from relax_core.run.sources import pin_source, source_problems
from relax_core.storage import is_committed, join, parent, where, write_json
from relax_core.tracking import format_summary
from relax_core.tracking.monitor import Monitor
from relax_core.tracking.runs import monitor_for, run_tags_of
from relax_core.train import checkpoint as ckpt
from relax_core.train.determinism import use_deterministic_kernels
from relax_core.train.loop import train_until

log = logging.getLogger(__name__)


def preflight(cfg: RunConfig) -> None:
    """Checks that need the filesystem or imports; one ConfigError listing every problem."""
    from relax_core.data.dataset import check_dataset_path
    from relax_core.rewards.registry import check_reward

    problems = []
    for name in ("train_path", "eval_path"):
        try:
            check_dataset_path(getattr(cfg.data, name))
        except (OSError, ValueError) as exc:
            problems.append(f"data.{name}: {exc}")
    try:
        check_reward(cfg.reward)
    except (ValueError, TypeError) as exc:
        text = str(exc)
        problems.append(text if text.startswith("reward.") else f"reward.name: {text}")
    if cfg.model.chat_template:
        from relax_core.run.prepare import read_chat_template

        try:
            read_chat_template(cfg.model.chat_template)
        except ValueError as exc:
            problems.append(str(exc))
    if cfg.env.episodic:
        from relax_core.roles.episodes import check_env

        problems += check_env(cfg)
    problems += source_problems(cfg)
    teacher = cfg.algorithm.teacher
    if teacher and not os.path.isfile(os.path.join(teacher, "config.json")):
        problems.append(
            f"algorithm.teacher: {teacher} is not a model directory (no config.json); give a "
            "checkpoint directory such as .relax/checkpoints/<run id>/step_000200"
        )
    _warn_emulated_bf16(cfg)
    from relax_core.ops.notify import check_notify

    problems += check_notify(cfg.services.notify)
    resume_from, options = cfg.checkpoint.resume_from, cfg.storage.options()
    problem = resume_from and ckpt.verify_checkpoint(resume_from, options)
    if problem:
        previous = ckpt.previous_complete(resume_from, options)
        problems.append(f"checkpoint.resume_from: {ckpt.refusal(problem, previous)}")
    if os.environ.get(CLUSTER_ENV):
        problems += cluster_problems(cfg)
    if not problems:
        # Storage last: it may wait on retries, and a typo above is cheaper to report first.
        from relax_core.queue import StorageError, check_queue_storage

        try:
            check_queue_storage(cfg.queue)
        except (StorageError, RuntimeError, OSError) as exc:
            problems.append(f"queue.root: {exc}")
    if problems:
        raise ConfigError("config cannot run:\n  - " + "\n  - ".join(problems))


def _warn_emulated_bf16(cfg: RunConfig) -> None:
    """A warning (not a refusal: the run works, slower) for bf16 matmuls on a CPU without
    native bf16; for 'auto', what this machine decided."""
    if not cfg.model.matmul_dtype:
        return
    import torch

    from relax_core.models.precision import (
        MATMUL_AUTO,
        cpu_lacks_native_bf16,
        resolve_matmul_dtype,
    )

    if cfg.model.matmul_dtype == MATMUL_AUTO:
        log.info(
            "model.matmul_dtype: auto computes in %s on this machine",
            resolve_matmul_dtype(MATMUL_AUTO) or "float32",
        )
    elif not torch.cuda.is_available() and cpu_lacks_native_bf16():
        log.warning(
            "model.matmul_dtype: %s on a CPU without native bf16 (no avx512_bf16 or amx_bf16 "
            "flag): its matmuls run 3-11x slower than float32 ones there; 'auto' computes in "
            "float32 on such a CPU (docs/gpus.md)",
            cfg.model.matmul_dtype,
        )


CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"
"""Set by Kubernetes in every pod (so in every task of a cluster execution), never locally."""


def cluster_problems(cfg: RunConfig) -> list[str]:
    """What breaks when every task is its own pod: run state or tracking on a pod's disk (the
    same check `relax plan --flyte` makes before submitting)."""
    from relax_core.ops.flyte_plan import pod_problems

    return pod_problems(cfg)


def start_run(cfg: RunConfig, policy_dir: str) -> str:
    """Checkpoint to continue from: the one to resume, or a new run's version 0 after eval."""
    options = cfg.storage.options()
    if cfg.checkpoint.resume_from:
        return where(cfg.checkpoint.resume_from)
    if cfg.checkpoint.resume:
        found = ckpt.find_resume_checkpoint(
            cfg.checkpoint.dir, cfg.run_name, options, cfg.checkpoint.fallback_to_previous
        )
        if found:
            log.info("resuming %s", found)
            return found
        log.warning(
            "resume: no checkpoint of run %r under %s; starting a new run",
            cfg.run_name,
            cfg.checkpoint.dir,
        )
    if not is_committed(policy_dir, MARKER, options):
        # Flyte's cache of prepare_policy can outlive what it returned (a pruned cache, another
        # storage root): prepare the same policy again instead of failing on a path.
        from relax_core.data.dataset import fingerprint
        from relax_core.run.prepare import prepare_policy

        log.warning("prepared policy %s is gone; preparing it again", policy_dir)
        spec = policy_spec_for(cfg, fingerprint(cfg.data.train_path))
        policy_dir = prepare_policy(
            spec, cfg.checkpoint.policy_cache_dir, options, cfg.storage.scratch_dir
        )
    run_id = f"{cfg.run_name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"
    state = RunState(run_id=run_id, policy_dir=policy_dir, started_at=time.time())
    # Opening the MLflow run (a new store's tables, the server's round trips) needs nothing from
    # the policy: it runs while the session loads the policy and evaluates it. mlflow is
    # imported first, here: two threads importing it at once can each find the other's
    # half-imported modules. Its errors surface here all the same, before step 0's checkpoint;
    # leaving the block waits for it whatever happened, and an MLflow run opened for a start
    # that failed is ended FAILED (a retry opens its own).
    from relax_core.tracking import mlflow_monitor  # noqa: F401  (mlflow: seconds)

    freeze_heap()

    with ThreadPoolExecutor(1, thread_name_prefix="relax-mlflow-start") as pool:
        tracking = pool.submit(_open_tracking, cfg, state.run_id)
        try:
            policy = local_policy(policy_dir, options, cfg.storage.scratch_dir)
            session = RunSession(cfg, policy, state, "start")
            try:
                state.eval_before = ColocateController(session).evaluate()
                monitor, state.tracking_run_id = tracking.result()
                monitor.log_metrics(state.eval_before, step=0)
                monitor.flush()
                return session.save_checkpoint()
            finally:
                session.close()
        except BaseException:
            _end_failed(tracking)
            raise


def _open_tracking(cfg: RunConfig, run_id: str) -> tuple[Monitor, str]:
    """A new run's monitor, started with the config as params; (monitor, MLflow run id)."""
    monitor = monitor_for(cfg, run_id)
    return monitor, monitor.start(dataclasses.asdict(cfg), run_tags_of(cfg, run_id))


def _end_failed(tracking: Future) -> None:
    """End the MLflow run `tracking` opened, if it opened one, as FAILED (best effort: the
    error being raised is the one that matters)."""
    if tracking.exception() is not None:
        return  # no MLflow run was opened
    try:
        monitor, _ = tracking.result()
        monitor.finish("FAILED")
    except Exception as exc:  # noqa: BLE001 - the start's own error is on its way up
        log.warning("could not end the MLflow run of a failed start: %s", exc)


def run_steps(cfg: RunConfig, checkpoint: str, max_steps: int) -> str:
    """Train from `checkpoint` for up to `max_steps` steps; returns the newest checkpoint."""
    session = RunSession.from_checkpoint(cfg, checkpoint)
    try:
        controller = ColocateController(session)
        controller.skip_orphans()
        freeze_heap()  # the session's model, optimizer and modules stay for every step
        state, total = session.state, cfg.train.total_steps
        target = min(total, state.policy_version + max_steps)
        if state.policy_version >= target:
            return checkpoint
        return train_until(
            cfg,
            state,
            target,
            controller.step,
            controller.evaluate,
            session.save_checkpoint,
            checkpoint,
        )
    finally:
        session.close()


def finish_run(cfg: RunConfig, checkpoint: str) -> dict[str, Any]:
    """Final held-out eval, close the MLflow run, print and return the summary."""
    session = RunSession.from_checkpoint(cfg, checkpoint, "evaluate")
    state = session.state
    try:
        after = ColocateController(session).evaluate()
    finally:
        session.close()
    monitor = monitor_for(cfg, state.run_id, state.tracking_run_id)
    monitor.start(dataclasses.asdict(cfg), run_tags_of(cfg, state.run_id))
    monitor.log_metrics(after, step=state.policy_version)
    monitor.flush()
    local = ckpt.local_checkpoint(checkpoint, cfg.storage.options(), cfg.storage.scratch_dir)
    registered = register_final_policy(cfg, state, local, after, monitor.tracking_uri)
    monitor.finish("FINISHED")
    unsent = monitor.unsent  # the tracking server was down: the spool files the metrics wait in
    summary = {
        "eval_accuracy_before": state.eval_before.get("eval/accuracy"),
        "eval_accuracy_after": after["eval/accuracy"],
        "steps": state.policy_version,
        "wall_time_s": time.time() - state.started_at,
        "mlflow_run_id": state.tracking_run_id,
        "mlflow_run_url": f"{monitor.tracking_uri}  {monitor.run_url()}",
        "mlflow_unsent": unsent,
        "checkpoint": where(checkpoint),
        "registered_model": registered,
        "compare_url": None if unsent else compare_with_previous(monitor.tracking_uri, monitor),
    }
    print(format_summary(summary), file=sys.stderr, flush=True)
    summary["run_id"] = state.run_id
    report = {**summary, "eval_before": state.eval_before, "eval_after": after}
    write_json(join(session.run_dir, "summary.json"), report, cfg.storage.options())
    return summary


def register_final_policy(
    cfg: RunConfig, state: RunState, checkpoint: str, after: dict[str, float], tracking_uri: str
) -> str | None:
    """Register the final checkpoint under `tracking.registered_model`; returns its models:/ URI."""
    name = cfg.tracking.registered_model
    if not name:
        return None
    from relax_core.tracking.registry import register_policy

    accuracy = after["eval/accuracy"]
    registered = register_policy(
        tracking_uri,
        state.tracking_run_id,
        checkpoint,
        name,
        model_config={
            "template": cfg.data.template,
            "system_prompt": cfg.data.system_prompt,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "matmul_dtype": cfg.model.matmul_dtype,
        },
        tags={
            "relax.run_id": state.run_id,
            "relax.policy_version": str(state.policy_version),
            "relax.eval_accuracy": f"{accuracy:.4f}",
            "relax.loss": cfg.algorithm.loss,
        },
        description=(
            f"{cfg.algorithm.loss} run {state.run_id}, policy version {state.policy_version}: "
            f"held-out accuracy {accuracy:.3f} on {cfg.data.eval_path}"
        ),
    )
    return registered.uri


def compare_with_previous(tracking_uri: str, monitor) -> str | None:
    """MLflow UI page comparing this run with the experiment's previous training run, if any."""
    from relax_core.tracking.compare import compare_url, previous_run, ui_base_url

    try:
        before = previous_run(tracking_uri, monitor.experiment_id, monitor.run_id)
    except Exception as exc:  # noqa: BLE001 - a summary line is not worth failing a finished run
        logging.getLogger(__name__).warning("no comparison link: %s", exc)
        return None
    if before is None:
        return None
    return compare_url(ui_base_url(), [monitor.experiment_id], [before, monitor.run_id])


def policy_spec_for(cfg: RunConfig, data_fingerprint: str):
    """The starting policy's spec, keyed on exact weights: a registry source (`models:/<name>/
    latest`, `@alias`) pinned to the version it names now, a URL source to its files' listing."""
    from relax_core.run.prepare import PolicySpec

    pinned, registry_uri, source_key = pin_source(cfg)
    return PolicySpec.of(pinned, data_fingerprint, registry_uri, source_key)


def read_version(checkpoint: str, options: dict | None = None) -> int:
    return int(ckpt.read_state(checkpoint, options)["policy_version"])


def newest_checkpoint(checkpoint: str, options: dict | None = None, fallback: bool = False) -> str:
    """The newest complete checkpoint of the run `checkpoint` belongs to (what a retried node
    resumes); a corrupt newest one is refused, or skipped if `fallback`
    (checkpoint.fallback_to_previous)."""
    found = ckpt.resume_checkpoint(parent(checkpoint), options, fallback)
    return found or where(checkpoint)


def run(cfg: RunConfig) -> dict[str, Any]:
    """The whole run from this process (what the Flyte workflow does node by node)."""
    from relax_core.data.dataset import fingerprint
    from relax_core.run.prepare import prepare_policy

    preflight(cfg)
    if cfg.train.torch_threads:
        torch.set_num_threads(cfg.train.torch_threads)
    use_deterministic_kernels(cfg.train.deterministic)
    spec = policy_spec_for(cfg, fingerprint(cfg.data.train_path))
    policy = prepare_policy(
        spec, cfg.checkpoint.policy_cache_dir, cfg.storage.options(), cfg.storage.scratch_dir
    )
    checkpoint = start_run(cfg, policy)
    options = cfg.storage.options()
    if cfg.mode == "async":
        # Outside Flyte there is one machine: the roles run as supervised local processes.
        from relax_core.ops.supervisor import run_async_local

        checkpoint = run_async_local(cfg, checkpoint)
    while cfg.mode == "colocate" and read_version(checkpoint, options) < cfg.train.total_steps:
        checkpoint = run_steps(cfg, checkpoint, cfg.train.steps_per_node)
    return finish_run(cfg, checkpoint)
