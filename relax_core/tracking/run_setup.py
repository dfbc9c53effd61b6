"""Opening an MLflow run for a monitor: its experiment (created on first use), a new run or an
existing one re-opened, and its params and tags in batches MLflow accepts."""

from __future__ import annotations

import logging
from pathlib import Path

from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from relax_core.tracking.outage import is_outage

_log = logging.getLogger(__name__)

MAX_PARAMS_TAGS_PER_BATCH = 100
"""MLflow's per-call limit for params and tags (mlflow.utils.validation)."""


def sqlite_artifact_location(tracking_uri: str) -> str | None:
    """`file://` URI of `mlartifacts/` next to a sqlite store's file; None for other stores.

    Without this MLflow would put a sqlite store's artifacts under `./mlruns` of whatever the
    current directory is when the experiment is created.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return None
    db_path = tracking_uri.removeprefix("sqlite:///")
    if db_path in ("", ":memory:"):
        return None
    return (Path(db_path).resolve().parent / "mlartifacts").as_uri()


def get_or_create_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    found = client.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    try:
        return client.create_experiment(
            name, artifact_location=sqlite_artifact_location(tracking_uri)
        )
    except MlflowException as err:
        if is_outage(err):
            raise
        # Another process (a second service of the same run) may have created it meanwhile.
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


def reopen_run(
    client: MlflowClient, run_id: str, flat: dict[str, str], tracking_uri: str
) -> tuple[str, dict[str, str]]:
    """Mark `run_id` RUNNING again; returns its experiment id and the params it does not have."""
    try:
        run = client.get_run(run_id)
    except MlflowException as err:
        if is_outage(err):
            raise
        raise LookupError(
            f"MLflowMonitor: resume_run_id {run_id!r} not found in {tracking_uri}"
        ) from err
    client.update_run(run_id, status="RUNNING")
    existing = run.data.params
    changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
    if changed:
        _log.warning(
            "MLflow run %s keeps its original values for changed params %s "
            "(MLflow does not allow changing a param)",
            run_id,
            changed,
        )
    return run.info.experiment_id, {k: v for k, v in flat.items() if k not in existing}


def send_params_and_tags(
    client: MlflowClient, run_id: str, params: dict[str, str], tags: dict[str, str]
) -> None:
    entries: list[Param | RunTag] = [Param(k, v) for k, v in params.items()]
    entries += [RunTag(k, str(v)) for k, v in tags.items()]
    for i in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
        chunk = entries[i : i + MAX_PARAMS_TAGS_PER_BATCH]
        client.log_batch(
            run_id,
            params=[e for e in chunk if isinstance(e, Param)],
            tags=[e for e in chunk if isinstance(e, RunTag)],
        )
