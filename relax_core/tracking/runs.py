"""Which MLflow run a training run logs to, the tracking URI it uses, and the tags that tie it
to its run id and, in a pod, to its Flyte execution."""

from __future__ import annotations

import logging
import os
import threading
from importlib.metadata import version
from pathlib import Path

from relax_core.config import RunConfig
from relax_core.tracking.monitor import Monitor

_log = logging.getLogger(__name__)


def default_tracking_uri(cwd: str | None = None) -> str:
    """MLFLOW_TRACKING_URI when set, else a sqlite store `mlflow.db` in `cwd` (default: the CWD).

    The sqlite path is made absolute so the URI still names the same store after a chdir.
    """
    from_env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if from_env:
        return from_env
    db = Path(cwd or os.getcwd()).resolve() / "mlflow.db"
    return f"sqlite:///{db}"


def tracking_uri_of(cfg: RunConfig) -> str:
    return cfg.tracking.tracking_uri or default_tracking_uri()


_warming: dict[str, threading.Thread] = {}
"""Tracking URI -> the thread opening its store ahead of the run (`open_store_early`)."""


def open_store_early(cfg: RunConfig) -> None:
    """Open the run's tracking store on a thread of its own, for a process that goes on to start
    the run itself (the launcher; a local Flyte execution, where every task runs in one
    process): a new sqlite store creates its tables, which takes a second or so, while the policy
    is prepared instead of before step 0. mlflow itself is imported here, on the calling thread:
    two threads importing mlflow at once can each find the other's half-imported modules. The
    first `monitor_for` of the same store waits for the thread, so two threads never create one
    store's tables at once, and the process does not exit midway through them. An error is left
    for that call to raise where it belongs."""
    uri = tracking_uri_of(cfg)
    if uri in _warming:
        return
    from mlflow import MlflowClient  # mlflow: seconds

    def open_store() -> None:
        try:
            MlflowClient(tracking_uri=uri)
        except Exception as exc:  # noqa: BLE001 - the run's own first MLflow call raises it
            _log.debug("opening the tracking store %s ahead of the run: %s", uri, exc)

    thread = threading.Thread(target=open_store, name="relax-mlflow-open")
    _warming[uri] = thread
    thread.start()


def monitor_for(cfg: RunConfig, run_id: str, tracking_run_id: str = "") -> Monitor:
    """The MLflow run a training run logs to: a new one, or `tracking_run_id` resumed. Metrics
    the tracking server cannot take while it is down are spooled under `storage.root`."""
    opening = _warming.get(tracking_uri_of(cfg))
    if opening is not None:
        opening.join()
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


def run_tags(run_id: str, mode: str) -> dict[str, str]:
    """Tags of a training run's MLflow run: ours, and the Flyte execution's when in a pod."""
    tags = {
        "relax.run_id": run_id,
        "relax.mode": mode,
        "relax.version": version("relax-flyte"),
    }
    for tag, variable in FLYTE_TAGS.items():
        if os.environ.get(variable):
            tags[tag] = os.environ[variable]
    return tags
