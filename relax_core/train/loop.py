"""The step loop both modes share: step, evaluate now and then, log, checkpoint.

Colocate (`run.run_steps`) and the async trainer differ in what one step is; what happens around
it (metrics to MLflow, progress, evals every `train.eval_every` steps, a checkpoint every
`train.checkpoint_every` steps and at the end, metrics flushed before every checkpoint) is here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from relax_core.config import RunConfig
from relax_core.tracking.console import ProgressBar
from relax_core.tracking.runs import monitor_for, run_tags_of
from relax_core.train import preemption
from relax_core.train.checkpoint import step_dir_name
from relax_core.train.run_state import RunState

log = logging.getLogger(__name__)


def train_until(
    cfg: RunConfig,
    state: RunState,
    target: int,
    step: Callable[[], dict[str, float]],
    evaluate: Callable[[], dict[str, float]],
    save: Callable[[], str],
    latest: str,
) -> str:
    """Run `step` until `state.policy_version` reaches `target`; returns the newest checkpoint."""
    total = cfg.train.total_steps
    monitor = monitor_for(cfg, state.run_id, state.tracking_run_id)
    monitor.start(dataclasses.asdict(cfg), run_tags_of(cfg, state.run_id))
    bar = ProgressBar(total, state.policy_version, enabled=cfg.tracking.progress)
    try:
        with preemption.checkpoint_on_sigterm():
            while state.policy_version < target:
                try:
                    metrics = step()
                except preemption.Interrupted:
                    metrics = None  # stopped while waiting for its inputs: nothing trained
                v = state.policy_version
                stop = preemption.requested()
                if metrics is not None:
                    every = cfg.train.eval_every
                    if every and v % every == 0 and v < total and not stop:
                        metrics.update(evaluate())
                    monitor.log_metrics(metrics, step=v)
                    bar.update(v, metrics)
                    _log_progress(cfg, metrics, v, target)
                if stop or v % cfg.train.checkpoint_every == 0 or v == target:
                    # Flushed first: a checkpoint never exists without the metrics that led to it.
                    monitor.flush()
                    if stop and metrics is None and _is_version(latest, v):
                        raise preemption.Preempted(latest, v)
                    latest = save()
                if stop:
                    raise preemption.Preempted(latest, v)
    finally:
        bar.close()
        monitor.flush()
    return latest


def _log_progress(cfg: RunConfig, metrics: dict[str, float], v: int, target: int) -> None:
    if not cfg.tracking.progress and (v % 10 == 0 or v == target):
        log.info(
            "step %d/%d reward %.3f staleness %.2f step %.3fs",
            v,
            cfg.train.total_steps,
            metrics.get("train/reward_mean", float("nan")),
            metrics.get("train/staleness_mean", float("nan")),
            metrics.get("perf/step_s", float("nan")),
        )


def _is_version(checkpoint: str, version: int) -> bool:
    """Whether `checkpoint` (a step directory) holds `version`: then there is nothing to save."""
    return checkpoint.rstrip("/").endswith(step_dir_name(version))
