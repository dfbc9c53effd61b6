"""Metrics MLflow has not accepted yet, kept in the run's storage so that losing the process (a
pod) does not lose them, and sending them once the tracking server answers again.

Every monitor writes its own file, `{spool dir}/{MLflow run id}.{writer}.json`, so the processes
of a run (start, the trainer, finish) never overwrite each other's. A file holds the tracking URI,
the MLflow run, the metrics in the order they were logged (each with the timestamp it was logged
at) and, when the run ended while the server was down, the terminal status it ended with.

Re-sending is safe: a metric is dropped from a file only after MLflow accepted it, and one that
MLflow accepted but whose reply was lost is sent again with the same key, step, timestamp and
value, which MLflow's SQL stores keep once (that tuple is the metrics table's primary key).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from relax_core.queue.store import ObjectStore
from relax_core.storage import join, where
from relax_core.tracking.outage import brief, is_outage

_log = logging.getLogger(__name__)

SPOOL_DIR = "mlflow-spool"
"""Where under `storage.root` the files are (`{storage.root}/mlflow-spool/`)."""
MAX_METRICS_PER_BATCH = 1000
"""MLflow's limit per log_batch call (mlflow.utils.validation): a larger batch is refused."""


def spool_dir_of(storage_root: str) -> str:
    return where(join(storage_root, SPOOL_DIR))


@dataclass
class Spooled:
    """One spool file's content."""

    tracking_uri: str
    run_id: str
    metrics: list[Metric]
    status: str | None = None
    """FINISHED, FAILED or KILLED when the run ended while the server was down."""
    end_time_ms: int | None = None

    def to_bytes(self) -> bytes:
        rows = [[m.key, m.value, m.timestamp, m.step] for m in self.metrics]
        doc = {
            "tracking_uri": self.tracking_uri,
            "run_id": self.run_id,
            "status": self.status,
            "end_time_ms": self.end_time_ms,
            "written_at": time.time(),
            "metrics": rows,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Spooled:
        doc = json.loads(data)
        metrics = [Metric(k, float(v), int(t), int(s)) for k, v, t, s in doc["metrics"]]
        return cls(doc["tracking_uri"], doc["run_id"], metrics, doc["status"], doc["end_time_ms"])


class MetricSpool:
    """The spool directory of a storage root, and this writer's own file in it."""

    def __init__(self, directory: str, options: dict | None = None) -> None:
        self.directory = where(directory)
        self._store = ObjectStore(self.directory, options)
        self._writer = uuid.uuid4().hex[:12]
        self._name: str | None = None

    def location(self, run_id: str) -> str:
        """Where this writer keeps the metrics of `run_id` (a path or URL a person can use)."""
        return join(self.directory, self._file(run_id))

    def save(self, content: Spooled) -> str:
        """Replace this writer's file with `content`; returns its location."""
        self._store.write_replace(self._file(content.run_id), content.to_bytes())
        return self.location(content.run_id)

    def clear(self) -> None:
        """Remove this writer's file (everything in it was accepted)."""
        if self._name is not None:
            self._store.delete(self._name)
            self._name = None

    def send_others(self, client: MlflowClient, tracking_uri: str, own_run: str = "") -> int:
        """Send the files other writers left for `tracking_uri`, then remove them; returns how
        many metrics went. The terminal status a file holds is set on its run if the run is
        still RUNNING, except on `own_run`, which the caller is running and ends itself.

        Raises on an outage (the files stay for the next try). A file MLflow refuses (its run was
        deleted) is left in place with a warning, and the others are still sent.
        """
        sent = 0
        for name in self._store.list_dir(""):
            if name == self._name or not name.endswith(".json"):
                continue
            raw, content = self._read(name)
            if content is None or content.tracking_uri != tracking_uri:
                continue
            try:
                sent += send(client, content, set_status=content.run_id != own_run)
            except Exception as err:
                if is_outage(err):
                    raise
                _log.warning(
                    "MLflow refused the metrics kept in %s (%s); the file stays",
                    join(self.directory, name),
                    brief(err),
                )
                continue
            # A writer that is still alive may have rewritten its file meanwhile (more metrics):
            # then it stays, and is cleared by that writer or sent again later (harmlessly).
            if self._read(name)[0] == raw:
                self._store.delete(name)
        return sent

    def files(self, run_id: str = "") -> list[str]:
        """Locations of the spool files in the directory (of `run_id`'s metrics, if given)."""
        names = [n for n in self._store.list_dir("") if n.endswith(".json")]
        if run_id:
            names = [n for n in names if n.startswith(f"{run_id}.")]
        return [join(self.directory, n) for n in names]

    def _read(self, name: str) -> tuple[bytes, Spooled | None]:
        """A file's bytes and content; (b"", None) if another process removed it meanwhile, and
        None content (with a warning) if it cannot be read as a spool file."""
        try:
            raw = self._store.read_bytes(name)
        except FileNotFoundError:
            return b"", None
        try:
            return raw, Spooled.from_bytes(raw)
        except (ValueError, KeyError, TypeError) as err:
            _log.warning("%s is not a metrics spool file (%s); left as it is", name, err)
            return raw, None

    def _file(self, run_id: str) -> str:
        if self._name is None:
            self._name = f"{run_id}.{self._writer}.json"
        return self._name


def send(client: MlflowClient, content: Spooled, set_status: bool = True) -> int:
    """Log `content`'s metrics in order (MLflow's batch limit per call), then its terminal status
    if the run was left RUNNING; returns how many metrics were sent."""
    for i in range(0, len(content.metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(content.run_id, metrics=content.metrics[i : i + MAX_METRICS_PER_BATCH])
    left_running = set_status and content.status
    if left_running and client.get_run(content.run_id).info.status == "RUNNING":
        client.set_terminated(content.run_id, content.status, end_time=content.end_time_ms)
    return len(content.metrics)
