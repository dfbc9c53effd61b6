"""Which MLflow run a training run logs to, the tracking URI it uses, and the tags that tie it
to its run id and, in a pod, to its Flyte execution."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version

from relax_core.config import RunConfig
from relax_core.tracking.monitor import Monitor
from relax_core.tracking.store import default_tracking_uri


def tracking_uri_of(cfg: RunConfig) -> str:
    return cfg.tracking.tracking_uri or default_tracking_uri()


def monitor_for(cfg: RunConfig, run_id: str, tracking_run_id: str = "") -> Monitor:
    """The MLflow run a training run logs to: a new one, or `tracking_run_id` resumed. Metrics
    the tracking server cannot take while it is down are spooled under `storage.root`. Its sends
    run beside training (MLflowMonitor's `send_in_background`)."""
    from relax_core.tracking.mlflow_monitor import MLflowMonitor  # mlflow: seconds
    from relax_core.tracking.spool import MetricSpool, spool_dir_of

    return MLflowMonitor(
        cfg.tracking.tracking_uri or None,
        cfg.tracking.experiment,
        run_name=run_id,
        resume_run_id=tracking_run_id or None,
        spool=MetricSpool(spool_dir_of(cfg.storage.root), cfg.storage.options()),
        request_timeout_s=cfg.tracking.request_timeout_s,
        request_retries=cfg.tracking.request_retries,
        send_in_background=True,
    )


FLYTE_TAGS = {
    "flyte.execution_id": "FLYTE_INTERNAL_EXECUTION_ID",
    "flyte.project": "FLYTE_INTERNAL_EXECUTION_PROJECT",
    "flyte.domain": "FLYTE_INTERNAL_EXECUTION_DOMAIN",
    "flyte.workflow": "FLYTE_INTERNAL_EXECUTION_WORKFLOW",
    "flyte.version": "FLYTE_INTERNAL_TASK_VERSION",
}
"""MLflow tag -> the variable Flyte sets in every task pod of an execution (absent in local
runs). The task version is the version the workflow was registered under."""


def _package_version() -> str:
    """The installed relax-flyte's version; 'source' when the package runs from a checkout on
    PYTHONPATH without being installed (an image that copies the repo, a GPU bring-up)."""
    try:
        return version("relax-flyte")
    except PackageNotFoundError:
        return "source"


def run_tags(run_id: str, mode: str) -> dict[str, str]:
    """Tags of a training run's MLflow run: ours, and the Flyte execution's when in a pod."""
    tags = {
        "relax.run_id": run_id,
        "relax.mode": mode,
        "relax.version": _package_version(),
    }
    for tag, variable in FLYTE_TAGS.items():
        if os.environ.get(variable):
            tags[tag] = os.environ[variable]
    return tags


def run_tags_of(cfg, run_id: str) -> dict[str, str]:
    """`run_tags` of a run of `cfg`, with what its `model.matmul_dtype` computes in here."""
    tags = run_tags(run_id, cfg.mode)
    if cfg.model.matmul_dtype:  # 'auto' says which it was
        from relax_core.models.precision import resolve_matmul_dtype

        tags["relax.matmul_dtype"] = resolve_matmul_dtype(cfg.model.matmul_dtype) or "float32"
    return tags
