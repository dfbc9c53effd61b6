"""A Monitor that records a training run in MLflow.

It talks to MLflow through its own `MlflowClient`, never the fluent global API (`mlflow.start_run`),
so several monitors in one process (trainer + evaluator, or tests) do not share an "active run".
Metrics are buffered and sent in `log_batch` calls, because one database round trip per metric
per step is what makes a tracker slow.
"""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from relax_core.tracking.monitor import flatten_params

_log = logging.getLogger(__name__)

# MLflow's per-call limits (mlflow.utils.validation): a larger batch is refused as a whole.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
_TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


def default_tracking_uri(cwd: str | None = None) -> str:
    """MLFLOW_TRACKING_URI when set, else a sqlite store `mlflow.db` in `cwd` (default: the CWD).

    The sqlite path is made absolute so the URI still names the same store after a chdir.
    """
    from_env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if from_env:
        return from_env
    db = Path(cwd or os.getcwd()).resolve() / "mlflow.db"
    return f"sqlite:///{db}"


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


class MLflowMonitor:
    """Monitor backed by an MLflow tracking store (sqlite file, or a tracking server's http URI).

    `resume_run_id` re-opens an existing run (after a trainer restart) instead of creating one:
    params it already has are not logged again, since MLflow refuses to change a param.
    `flush_every` is how many distinct steps are buffered before metrics are sent.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str | None = None,
        resume_run_id: str | None = None,
        flush_every: int = 10,
    ) -> None:
        if not experiment or not experiment.strip():
            raise ValueError("MLflowMonitor: experiment must be a non-empty name")
        if flush_every < 1:
            raise ValueError(f"MLflowMonitor: flush_every must be >= 1, got {flush_every}")
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.experiment = experiment
        self.run_name = run_name
        self.resume_run_id = resume_run_id
        self.flush_every = flush_every
        self.nonfinite_skipped: dict[str, int] = {}
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._buffer: list[Metric] = []
        self._buffered_steps: set[int] = set()
        self._finished = False

    @property
    def run_id(self) -> str:
        """The id of the started run; raises if `start` has not been called."""
        return self._require_run()

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            raise RuntimeError("MLflowMonitor: call start() before asking for the experiment")
        return self._experiment_id

    def start(self, params: dict[str, object], tags: dict[str, str]) -> str:
        if self._run_id is not None:
            raise RuntimeError(f"MLflowMonitor: run {self._run_id} was already started")
        flat = flatten_params(params)
        if self.resume_run_id:
            flat = self._reopen(self.resume_run_id, flat)
        else:
            self._experiment_id = self._get_or_create_experiment()
            run = self._client.create_run(self._experiment_id, run_name=self.run_name)
            self._run_id = run.info.run_id
        self._send_params_and_tags(flat, tags)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._require_run()
        if self._finished:
            raise RuntimeError(f"MLflowMonitor: run {self._run_id} is finished; cannot log")
        timestamp_ms = int(time.time() * 1000)
        for key, raw in metrics.items():
            value = float(raw)
            if not math.isfinite(value):
                self._count_nonfinite(key, value, step)
                continue
            self._buffer.append(Metric(key, value, timestamp_ms, step))
        self._buffered_steps.add(step)
        if len(self._buffered_steps) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        run_id = self._run_id
        if run_id is None:
            return
        # Drop each chunk from the buffer only once MLflow accepted it: nothing is sent twice.
        while self._buffer:
            chunk = self._buffer[:MAX_METRICS_PER_BATCH]
            self._client.log_batch(run_id, metrics=chunk)
            del self._buffer[: len(chunk)]
        self._buffered_steps.clear()

    def log_artifact(self, path: str) -> None:
        run_id = self._require_run()
        local = Path(path)
        if not local.exists():
            raise FileNotFoundError(f"MLflowMonitor.log_artifact: no such file or directory {path}")
        if local.is_dir():
            self._client.log_artifacts(run_id, str(local), artifact_path=local.name)
        else:
            self._client.log_artifact(run_id, str(local))

    def finish(self, status: str = "FINISHED") -> None:
        if status not in _TERMINAL_STATUSES:
            raise ValueError(f"MLflowMonitor.finish: status must be one of {_TERMINAL_STATUSES}")
        # A no-op before start, so cleanup code can call it on any path without masking an error.
        if self._finished or self._run_id is None:
            return
        self.flush()
        if self.nonfinite_skipped:
            _log.warning(
                "MLflow run %s: skipped %d non-finite metric values %s",
                self._run_id,
                sum(self.nonfinite_skipped.values()),
                dict(sorted(self.nonfinite_skipped.items())),
            )
        self._client.set_terminated(self.run_id, status=status)
        self._finished = True

    def run_url(self) -> str:
        """The run's page in the MLflow UI, relative to the tracking server's base URL."""
        return f"#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def _require_run(self) -> str:
        if self._run_id is None:
            raise RuntimeError("MLflowMonitor: call start() before logging")
        return self._run_id

    def _get_or_create_experiment(self) -> str:
        found = self._client.get_experiment_by_name(self.experiment)
        if found is not None:
            return found.experiment_id
        try:
            return self._client.create_experiment(
                self.experiment, artifact_location=sqlite_artifact_location(self.tracking_uri)
            )
        except MlflowException:
            # Another process (a second service of the same run) may have created it meanwhile.
            found = self._client.get_experiment_by_name(self.experiment)
            if found is None:
                raise
            return found.experiment_id

    def _reopen(self, run_id: str, flat: dict[str, str]) -> dict[str, str]:
        """Mark `run_id` RUNNING again; returns the params it does not have yet."""
        try:
            run = self._client.get_run(run_id)
        except MlflowException as err:
            raise LookupError(
                f"MLflowMonitor: resume_run_id {run_id!r} not found in {self.tracking_uri}"
            ) from err
        self._run_id = run.info.run_id
        self._experiment_id = run.info.experiment_id
        self._client.update_run(run_id, status="RUNNING")
        existing = run.data.params
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != v)
        if changed:
            _log.warning(
                "MLflow run %s keeps its original values for changed params %s "
                "(MLflow does not allow changing a param)",
                run_id,
                changed,
            )
        return {k: v for k, v in flat.items() if k not in existing}

    def _send_params_and_tags(self, params: dict[str, str], tags: dict[str, str]) -> None:
        run_id = self._require_run()
        entries: list[Param | RunTag] = [Param(k, v) for k, v in params.items()]
        entries += [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(entries), MAX_PARAMS_TAGS_PER_BATCH):
            chunk = entries[i : i + MAX_PARAMS_TAGS_PER_BATCH]
            self._client.log_batch(
                run_id,
                params=[e for e in chunk if isinstance(e, Param)],
                tags=[e for e in chunk if isinstance(e, RunTag)],
            )

    def _count_nonfinite(self, key: str, value: float, step: int) -> None:
        count = self.nonfinite_skipped.get(key, 0)
        if count == 0:
            _log.warning(
                "metric %r is %s at step %d; not sent to MLflow (counted)", key, value, step
            )
        self.nonfinite_skipped[key] = count + 1
