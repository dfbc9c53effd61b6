"""An MLflow tracking server that goes down mid-run loses no metric and stores none twice.

A real `mlflow server` (sqlite store) runs as a subprocess on a free loopback port. The tests
kill it with SIGKILL (its pod is gone), keep logging through MLflowMonitor, start it again on the
same port and store, and read every metric's history back over HTTP.
"""

import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

# mlflow decides whether to start its telemetry client when it is imported, so this must come first.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from relax_core.entrypoints.cli import main
from relax_core.tracking.mlflow_monitor import MLflowMonitor
from relax_core.tracking.spool import MetricSpool, Spooled, spool_dir_of
from tests.s3servers import free_ports, http_ok, kill_group, log_tail, spawn_logged, stop_group

pytestmark = [pytest.mark.integration]

EXPERIMENT = "relax-outage"
START_TIMEOUT_S = 90.0
KEYS = ("train/reward_mean", "perf/step_s")


class MlflowServer:
    """`mlflow server` on a fixed loopback port and sqlite store, killed and started at will."""

    def __init__(self, root: Path) -> None:
        (port,) = free_ports(1)
        self.uri = f"http://127.0.0.1:{port}"
        self.root = root
        self.command = [
            sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
            "--default-artifact-root", str(root / "art"),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--workers", "1",  # each worker imports mlflow: seconds of CPU apiece
        ]  # fmt: skip
        self.log_path = root / "mlflow-server.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        # No job runner: its four huey consumer processes serve nothing these tests use.
        env = {
            **os.environ,
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        self.process = spawn_logged(self.command, self.log_path, env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not http_ok(f"{self.uri}/health"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server at {self.uri} did not start: ...\n" + self.tail()
                )
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server and its workers, as when its pod is lost."""
        assert self.process is not None
        kill_group(self.process)

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)

    def tail(self) -> str:
        return log_tail(self.log_path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    running = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    running.start()
    try:
        yield running
    finally:
        running.stop()


class Records(logging.Handler):
    """The warnings relax_core.tracking logs while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def having(self, text: str) -> list[str]:
        return [m for m in self.messages if text in m]


class Outage:
    """What one outage of the server left: the monitors that lived through it, what they
    said, kept and raised."""

    storage: Path
    logs: Records
    trainer: MLflowMonitor
    trainer_kept: dict
    trainer_spool: str
    ended_run: str
    ended_spool: list[str]
    lost_run: str
    new_run_error: Exception | None


@pytest.fixture(scope="module")
def outage(server: MlflowServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    """One outage (SIGKILL, then a start on the same port and store) lived through by each kind
    of writer a run has: a trainer that logs on; a run whose steps node and finish node both run
    while the server is down; a trainer whose process is lost and the one that resumes its run
    while the server is still down. The tests read what each left in the run's history."""
    o = Outage()
    o.storage = tmp_path_factory.mktemp("storage")
    o.logs = Records()
    logger = logging.getLogger("relax_core.tracking")
    logger.addHandler(o.logs)
    try:
        o.trainer = _monitor(server.uri, o.storage, run_name="trainer")
        o.trainer.start({"lr": 0.1}, tags={})
        _log(o.trainer, range(0, 4))
        o.ended_run = _monitor(server.uri, o.storage, run_name="ended").start({}, tags={})
        _log_node(server.uri, o.storage, o.ended_run, range(0, 2))  # start_run's eval
        lost = _monitor(server.uri, o.storage, run_name="lost")
        o.lost_run = lost.start({}, tags={})
        _log(lost, range(0, 2))

        server.kill()
        _log(o.trainer, range(4, 10))  # three flushes that find the server down
        (o.trainer_spool,) = o.trainer.unsent
        o.trainer_kept = json.loads(Path(o.trainer_spool).read_text())
        _log_node(server.uri, o.storage, o.ended_run, range(2, 4))  # run_steps
        final = _monitor(server.uri, o.storage, resume_run_id=o.ended_run)  # finish_run
        final.start({}, tags={})
        _log(final, range(4, 6))
        final.finish()  # the run ends; its status waits with its metrics
        o.ended_spool = final.unsent
        _log(lost, range(2, 6))
        del lost  # its process is gone: what it logged is only in its spool file
        o.new_run_error = None
        try:
            _monitor(server.uri, o.storage, run_name="new").start({}, tags={})
        except ConnectionError as err:
            o.new_run_error = err
        resumed = _monitor(server.uri, o.storage, resume_run_id=o.lost_run)
        resumed.start({}, tags={})  # a resumed trainer trains on
        _log(resumed, range(6, 8))

        server.start()
        _log(o.trainer, range(10, 12))  # this flush finds the server back
        o.trainer.finish()
        following = _monitor(server.uri, o.storage, run_name="following")
        following.start({}, tags={})  # sends the spool files under the storage root
        _log(resumed, range(8, 10))  # sends its own again, 6 and 7 included: stored once
        resumed.finish()
        following.finish()
        yield o
    finally:
        logger.removeHandler(o.logs)


@pytest.mark.slow
def test_a_trainer_logs_through_an_outage_and_its_history_has_every_step_once(
    server: MlflowServer, outage: Outage
):
    # While down, what it logged was kept in the run's storage, not only in memory.
    assert sorted({row[3] for row in outage.trainer_kept["metrics"]}) == list(range(4, 10))
    assert outage.trainer.unsent == [] and not Path(outage.trainer_spool).exists()
    assert _history(server.uri, outage.trainer.run_id) == _expected(range(12))
    assert MlflowClient(server.uri).get_run(outage.trainer.run_id).info.status == "FINISHED"


def test_one_warning_when_the_outage_starts_and_one_when_it_ends(outage: Outage):
    trainer = outage.trainer.run_id
    down = [m for m in outage.logs.having("is unreachable") if trainer in m]
    assert len(down) == 1, down  # not one per flush
    assert outage.trainer.tracking_uri in down[0] and outage.trainer_spool in down[0]
    (back,) = [m for m in outage.logs.having("answers again") if trainer in m]
    assert trainer in back and "sent the 16 metrics" in back  # steps 4..11, two keys each


def test_a_run_that_ends_while_down_names_its_spools_and_a_later_start_sends_them(
    server: MlflowServer, outage: Outage
):
    assert len(outage.ended_spool) == 2  # the steps node's file and the finish node's
    (said,) = outage.logs.having("still unreachable")
    assert all(f in said for f in outage.ended_spool) and "FINISHED" in said
    assert not any(Path(f).exists() for f in outage.ended_spool)  # sent, then removed
    assert MlflowClient(server.uri).get_run(outage.ended_run).info.status == "FINISHED"
    assert _history(server.uri, outage.ended_run) == _expected(range(6))


def test_a_lost_trainers_metrics_reach_its_resumed_run_once(server: MlflowServer, outage: Outage):
    assert _history(server.uri, outage.lost_run) == _expected(range(10))
    assert MlflowClient(server.uri).get_run(outage.lost_run).info.status == "FINISHED"
    assert list(Path(spool_dir_of(str(outage.storage))).iterdir()) == []


def test_a_new_run_cannot_start_while_the_server_is_down(outage: Outage):
    assert isinstance(outage.new_run_error, ConnectionError)
    assert outage.trainer.tracking_uri in str(outage.new_run_error)


def test_a_refusal_is_not_an_outage(server: MlflowServer, outage: Outage, tmp_path: Path):
    monitor = _monitor(server.uri, tmp_path, resume_run_id="0" * 32)
    with pytest.raises(LookupError, match="0{32}"):
        monitor.start({}, tags={})


def test_relax_send_metrics_sends_what_runs_left_for_its_tracking_uri(
    server: MlflowServer, outage: Outage, tmp_path: Path, capsys: pytest.CaptureFixture
):
    uri = server.uri  # up again after the outage
    run_id = MLflowMonitor(uri, EXPERIMENT).start({}, tags={})
    storage = tmp_path / "storage"
    metrics = [Metric(k, v, 1764000000000 + s, s) for s in range(3) for k, v in _point(s).items()]
    mine = MetricSpool(spool_dir_of(str(storage))).save(Spooled(uri, run_id, metrics, "FAILED"))
    other = MetricSpool(spool_dir_of(str(storage))).save(Spooled("http://elsewhere", "x", []))

    assert main(["send-metrics", str(storage), "--tracking-uri", uri]) == 1  # one file is left
    assert f"left: {other}" in capsys.readouterr().err
    assert not Path(mine).exists() and Path(other).exists()
    assert _history(uri, run_id) == _expected(range(3))
    assert MlflowClient(uri).get_run(run_id).info.status == "FAILED"


def _point(step: int) -> dict[str, float]:
    return {KEYS[0]: 0.25 * step, KEYS[1]: 1.0 + step}


def _monitor(uri: str, storage: Path, **kwargs) -> MLflowMonitor:
    spool = MetricSpool(spool_dir_of(str(storage)))
    return MLflowMonitor(uri, EXPERIMENT, flush_every=2, spool=spool, request_timeout_s=2, **kwargs)


def _log_node(uri: str, storage: Path, run_id: str, steps: range) -> None:
    """A node of the run (its own process) that logs `steps` and ends without finishing."""
    node = _monitor(uri, storage, resume_run_id=run_id)
    node.start({}, tags={})
    _log(node, steps)
    node.flush()


def _log(monitor: MLflowMonitor, steps: range) -> None:
    for step in steps:
        monitor.log_metrics(_point(step), step)


def _history(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every stored point per key, sorted, duplicates kept (so a metric stored twice shows)."""
    reader = MlflowClient(uri)
    return {
        k: sorted((m.step, m.value) for m in reader.get_metric_history(run_id, k)) for k in KEYS
    }


def _expected(steps: range) -> dict[str, list[tuple[int, float]]]:
    return {KEYS[0]: [(s, 0.25 * s) for s in steps], KEYS[1]: [(s, 1.0 + s) for s in steps]}
