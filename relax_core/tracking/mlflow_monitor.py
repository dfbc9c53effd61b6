"""A Monitor that records a training run in MLflow.

It talks to MLflow through its own `MlflowClient`, never the fluent global API (`mlflow.start_run`),
so several monitors in one process (trainer + evaluator, or tests) do not share an "active run".
Metrics are buffered and sent in `log_batch` calls, because one database round trip per metric
per step is what makes a tracker slow. With `send_in_background` (a run's monitor, runs.py) the
sends that `flush_every` triggers run on a thread of the monitor's own while training goes on:
MLflow's client spends ~80 us of Python per metric, 3 ms per step of the CPU default, which
otherwise sits between two steps. `flush()` and `finish()` still return only once MLflow holds
every metric logged before them (a checkpoint never exists without the metrics that led to it),
and an error of a background send is raised by the next call that logs or flushes.

While the tracking server is down (outage.py) training goes on: the monitor keeps every metric in
order, in memory and in its spool file in the run's storage (spool.py), tries again at each
flush with short requests, and sends them once the server answers. A run that ends meanwhile
leaves the spool file, with its terminal status, for the next monitor that starts on that
storage (or `relax send-metrics`) to send.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from relax_core.tracking.monitor import flatten_params
from relax_core.tracking.outage import brief, is_outage, quick_requests
from relax_core.tracking.run_setup import (
    get_or_create_experiment,
    reopen_run,
    send_params_and_tags,
)
from relax_core.tracking.spool import MAX_METRICS_PER_BATCH, MetricSpool, Spooled
from relax_core.tracking.store import default_tracking_uri, seed_sqlite_store

_log = logging.getLogger(__name__)

_TERMINAL_STATUSES = ("FINISHED", "FAILED", "KILLED")


class MLflowMonitor:
    """Monitor backed by an MLflow tracking store (sqlite file, or a tracking server's http URI).

    `resume_run_id` re-opens an existing run (after a trainer restart) instead of creating one:
    params it already has are not logged again, since MLflow refuses to change a param. If the
    server is down then, the run trains on and is re-opened once the server answers; a new run
    cannot be created without it.
    `flush_every` is how many distinct steps are buffered before metrics are sent.
    `spool` keeps unsent metrics in the run's storage during an outage (without one they are
    kept in memory only, and ending the run while the server is down is an error).
    `request_timeout_s` and `request_retries` bound each of the monitor's requests.
    `send_in_background`: the sends `flush_every` triggers run on the monitor's thread, one at a
    time (metrics logged meanwhile wait for the next); `flush` waits for them.
    """

    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str | None = None,
        resume_run_id: str | None = None,
        flush_every: int = 10,
        spool: MetricSpool | None = None,
        request_timeout_s: int = 5,
        request_retries: int = 1,
        send_in_background: bool = False,
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
        self.spool = spool
        self.request_timeout_s = request_timeout_s
        self.request_retries = request_retries
        self.send_in_background = send_in_background
        self.nonfinite_skipped: dict[str, int] = {}
        seed_sqlite_store(self.tracking_uri)  # a new local store skips MLflow's migrations
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._run_id: str | None = None
        self._experiment_id: str | None = None
        self._pending: list[Metric] = []  # logged, not yet accepted by MLflow; in logged order
        self._lock = threading.Lock()  # _pending: appended by log_metrics, sent by the sender
        self._sender: ThreadPoolExecutor | None = None
        self._sending: Future | None = None  # the background send in flight, if any
        self._buffered_steps: set[int] = set()
        self._reopen_args: tuple[dict[str, str], dict[str, str]] | None = None
        self._others_sent = False
        self._down_since: float | None = None
        self._spooled: str | None = None  # this monitor's spool file, while it exists
        self._left: list[str] = []
        self._finished = False

    @property
    def run_id(self) -> str:
        """The id of the started run; raises if `start` has not been called."""
        return self._require_run()

    @property
    def experiment_id(self) -> str:
        if self._experiment_id is None:
            raise RuntimeError(
                "MLflowMonitor: the run's experiment is not known: call start() first, or the "
                f"server at {self.tracking_uri} has not answered since"
            )
        return self._experiment_id

    @property
    def unsent(self) -> list[str]:
        """The spool files holding metrics of this run MLflow has not accepted yet: this
        monitor's own, and after a finish while the server is down, those earlier processes of
        the run left too."""
        return self._left or ([self._spooled] if self._spooled else [])

    def start(self, params: dict[str, object], tags: dict[str, str]) -> str:
        if self._run_id is not None:
            raise RuntimeError(f"MLflowMonitor: run {self._run_id} was already started")
        flat = flatten_params(params)
        if self.resume_run_id:
            self._run_id = self.resume_run_id
            self._reopen_args = (flat, tags)
        else:
            self._create_run(flat, tags)
        down = self._attempt(self._connect)
        if down is not None:
            self._outage(down)
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._require_run()
        if self._finished:
            raise RuntimeError(f"MLflowMonitor: run {self._run_id} is finished; cannot log")
        timestamp_ms = int(time.time() * 1000)
        logged = []
        for key, raw in metrics.items():
            value = float(raw)
            if not math.isfinite(value):
                self._count_nonfinite(key, value, step)
                continue
            logged.append(Metric(key, value, timestamp_ms, step))
        with self._lock:
            self._pending.extend(logged)
        self._buffered_steps.add(step)
        if len(self._buffered_steps) < self.flush_every:
            return
        if not self.send_in_background:
            self.flush()
            return
        self._buffered_steps.clear()
        if self._sending is not None and not self._sending.done():
            return  # one send at a time: what is logged meanwhile goes with the next
        self._wait_for_send()  # raises what the last one raised
        if self._sender is None:
            self._sender = ThreadPoolExecutor(1, thread_name_prefix="relax-mlflow-send")
        self._sending = self._sender.submit(self._send_all)

    def flush(self) -> None:
        """Send every metric logged so far; returns once MLflow holds them, or they are kept for
        an outage (spool)."""
        if self._run_id is None:
            return
        self._buffered_steps.clear()
        self._wait_for_send()
        self._send_all()

    def _wait_for_send(self) -> None:
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.result()

    def _send_all(self) -> None:
        run_id = self._run_id
        with self._lock:
            late = len(self._pending)
        down = self._attempt(self._send_pending)
        if down is not None:
            self._outage(down)
            self._keep()
            return
        if self._spooled is not None and self.spool is not None:
            self.spool.clear()
            self._spooled = None
        if self._down_since is not None:
            _log.warning(
                "MLflow tracking server at %s answers again after %.0f s; sent the %d metrics "
                "of run %s kept meanwhile",
                self.tracking_uri,
                time.monotonic() - self._down_since,
                late,
                run_id,
            )
            self._down_since = None

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
        if self._sender is not None:
            self._sender.shutdown()
            self._sender = None
        if self.nonfinite_skipped:
            _log.warning(
                "MLflow run %s: skipped %d non-finite metric values %s",
                self._run_id,
                sum(self.nonfinite_skipped.values()),
                dict(sorted(self.nonfinite_skipped.items())),
            )
        if self._down_since is None:
            down = self._attempt(lambda: self._client.set_terminated(self.run_id, status=status))
            if down is not None:
                self._outage(down)
        self._finished = True
        if self._down_since is not None:
            self._end_while_down(status)

    def run_url(self) -> str:
        """The run's page in the MLflow UI, relative to the tracking server's base URL."""
        if self._experiment_id is None:  # the server has not answered since start
            return f"#/runs/{self.run_id}"
        return f"#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def _require_run(self) -> str:
        if self._run_id is None:
            raise RuntimeError("MLflowMonitor: call start() before logging")
        return self._run_id

    def _attempt(self, call: Callable[[], object]) -> Exception | None:
        """Run `call` with the monitor's short requests; returns the error if the server is down
        (any other error is raised)."""
        try:
            with quick_requests(self.request_timeout_s, self.request_retries):
                call()
        except Exception as err:
            if not is_outage(err):
                raise
            return err
        return None

    def _send_pending(self) -> None:
        self._connect()
        # Drop each chunk only once MLflow accepted it: nothing is lost, nor sent twice. Only
        # log_metrics adds to the list meanwhile, at its end.
        while True:
            with self._lock:
                chunk = self._pending[:MAX_METRICS_PER_BATCH]
            if not chunk:
                return
            self._client.log_batch(self.run_id, metrics=chunk)
            with self._lock:
                del self._pending[: len(chunk)]

    def _create_run(self, flat: dict[str, str], tags: dict[str, str]) -> None:
        down = self._attempt(lambda: self._open_new_run(flat, tags))
        if down is not None:
            raise ConnectionError(
                f"MLflow tracking server at {self.tracking_uri} is unreachable ({brief(down)}); "
                "a new run cannot start without it. Start the server, or point "
                "tracking.tracking_uri (or MLFLOW_TRACKING_URI) at one that answers"
            ) from down

    def _open_new_run(self, flat: dict[str, str], tags: dict[str, str]) -> None:
        self._experiment_id = get_or_create_experiment(
            self._client, self.experiment, self.tracking_uri
        )
        run = self._client.create_run(self._experiment_id, run_name=self.run_name)
        self._run_id = run.info.run_id
        send_params_and_tags(self._client, self._run_id, flat, tags)

    def _connect(self) -> None:
        """What waits for the server after start: re-opening a resumed run, then the metrics
        other writers left in the spool directory."""
        if self._reopen_args is not None:
            flat, tags = self._reopen_args
            self._experiment_id, new = reopen_run(
                self._client, self.run_id, flat, self.tracking_uri
            )
            send_params_and_tags(self._client, self.run_id, new, tags)
            self._reopen_args = None
        if not self._others_sent:
            if self.spool is not None:
                sent = self.spool.send_others(self._client, self.tracking_uri, self.run_id)
                if sent:
                    _log.warning(
                        "sent %d metrics that earlier processes left unsent in %s",
                        sent,
                        self.spool.directory,
                    )
            self._others_sent = True

    def _outage(self, err: BaseException) -> None:
        if self._down_since is not None:
            return
        self._down_since = time.monotonic()
        kept = "in memory only" if self.spool is None else f"in {self.spool.location(self.run_id)}"
        _log.warning(
            "MLflow tracking server at %s is unreachable (%s); training goes on. Metrics of run "
            "%s are kept %s and sent when the server answers (tried at each flush)",
            self.tracking_uri,
            brief(err),
            self.run_id,
            kept,
        )

    def _keep(self, status: str | None = None) -> None:
        """Write the spool file (what is pending, and the terminal status to set)."""
        if self.spool is None or not (self._pending or status or self._spooled):
            return
        end = int(time.time() * 1000) if status else None
        with self._lock:
            pending = list(self._pending)
        content = Spooled(self.tracking_uri, self.run_id, pending, status, end)
        self._spooled = self.spool.save(content)

    def _end_while_down(self, status: str) -> None:
        if self.spool is None:
            raise ConnectionError(
                f"MLflow tracking server at {self.tracking_uri} is unreachable: run "
                f"{self.run_id} ends with {len(self._pending)} metrics unsent and its status "
                "unset, and this monitor has no spool to keep them in"
            )
        self._keep(status)
        self._left = self.spool.files(self.run_id)
        _log.warning(
            "MLflow tracking server at %s is still unreachable: run %s ends with its status "
            "(%s) not yet set and metrics unsent, kept in %s. They are sent, and the status set, "
            "when a run next starts on this storage while the server answers, or by "
            "`relax send-metrics %s`",
            self.tracking_uri,
            self.run_id,
            status,
            ", ".join(self._left),
            self.spool.directory,
        )

    def _count_nonfinite(self, key: str, value: float, step: int) -> None:
        count = self.nonfinite_skipped.get(key, 0)
        if count == 0:
            _log.warning(
                "metric %r is %s at step %d; not sent to MLflow (counted)", key, value, step
            )
        self.nonfinite_skipped[key] = count + 1
