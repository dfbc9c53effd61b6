"""MLflowMonitor against a real sqlite MLflow store, read back with a separate MlflowClient."""

import logging
import os
import sqlite3
from pathlib import Path

# mlflow decides whether to start its telemetry client when it is imported, so this must come first.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from relax_core.tracking.mlflow_monitor import MLflowMonitor
from relax_core.tracking.monitor import PARAM_VALUE_MAX_CHARS, flatten_params
from relax_core.tracking.store import default_tracking_uri

EXPERIMENT = "relax-test"
PARAMS = {"algo": {"name": "grpo", "eps_clip": 0.2}, "optim": {"lr": 1e-6}, "seed": 7}


def reward_at(step: int) -> float:
    return 0.25 * step  # exact in binary floating point, so compared with ==


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """One sqlite store per module (the first monitor starts it from the shipped empty store)."""
    root = tmp_path_factory.mktemp("mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", root


@pytest.fixture(scope="module")
def reader(store: tuple[str, Path]) -> MlflowClient:
    return MlflowClient(tracking_uri=store[0])


@pytest.fixture(scope="module")
def first_run(store: tuple[str, Path]) -> MLflowMonitor:
    """25 steps (0..24) with a NaN at step 3 and an inf at step 4, then finished."""
    monitor = MLflowMonitor(store[0], EXPERIMENT, run_name="first", flush_every=10)
    monitor.start(PARAMS, tags={"flyte.execution_id": "exec-1"})
    for step in range(25):
        kl = {3: float("nan"), 4: float("inf")}.get(step, 0.01)
        monitor.log_metrics({"train/reward_mean": reward_at(step), "train/kl": kl}, step)
    monitor.finish()
    return monitor


def test_params_tags_and_status_are_recorded(first_run: MLflowMonitor, reader: MlflowClient):
    run = reader.get_run(first_run.run_id)
    assert run.data.params == {
        "algo.name": "grpo",
        "algo.eps_clip": "0.2",
        "optim.lr": "1e-06",
        "seed": "7",
    }
    assert run.data.tags["flyte.execution_id"] == "exec-1"
    assert run.info.run_name == "first"
    assert run.info.status == "FINISHED"


def test_metric_history_has_every_step_in_order(first_run: MLflowMonitor, reader: MlflowClient):
    history = reader.get_metric_history(first_run.run_id, "train/reward_mean")
    points = sorted((m.step, m.value) for m in history)
    assert points == [(s, reward_at(s)) for s in range(25)]


def test_non_finite_values_are_skipped_and_counted(first_run: MLflowMonitor, reader: MlflowClient):
    history = reader.get_metric_history(first_run.run_id, "train/kl")
    # 25 steps minus the NaN at step 3 and the inf at step 4.
    assert sorted(m.step for m in history) == [s for s in range(25) if s not in (3, 4)]
    assert first_run.nonfinite_skipped == {"train/kl": 2}


def test_run_url_points_at_the_run(first_run: MLflowMonitor, reader: MlflowClient):
    experiment_id = reader.get_experiment_by_name(EXPERIMENT).experiment_id
    assert first_run.run_url() == f"#/experiments/{experiment_id}/runs/{first_run.run_id}"


def test_resume_continues_the_same_run(
    first_run: MLflowMonitor, reader: MlflowClient, store: tuple[str, Path], caplog
):
    changed = {**PARAMS, "optim": {"lr": 5e-6}, "resumed_from": "ckpt-25"}
    monitor = MLflowMonitor(store[0], EXPERIMENT, resume_run_id=first_run.run_id, flush_every=10)
    with caplog.at_level(logging.WARNING):
        assert monitor.start(changed, tags={"attempt": "2"}) == first_run.run_id
    assert reader.get_run(first_run.run_id).info.status == "RUNNING"
    assert "optim.lr" in caplog.text  # the user is told the changed param was not applied
    for step in range(25, 30):
        monitor.log_metrics({"train/reward_mean": reward_at(step)}, step)
    monitor.finish()

    experiment_id = reader.get_experiment_by_name(EXPERIMENT).experiment_id
    runs = reader.search_runs([experiment_id], filter_string="attributes.run_name = 'first'")
    assert [r.info.run_id for r in runs] == [first_run.run_id]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "1e-06"  # MLflow keeps the first value of a param
    assert run.data.params["resumed_from"] == "ckpt-25"
    assert run.data.tags["attempt"] == "2"
    history = reader.get_metric_history(first_run.run_id, "train/reward_mean")
    assert sorted((m.step, m.value) for m in history) == [(s, reward_at(s)) for s in range(30)]


def test_metrics_are_sent_every_flush_every_steps(store: tuple[str, Path], reader: MlflowClient):
    monitor = MLflowMonitor(store[0], EXPERIMENT, flush_every=3)
    run_id = monitor.start({}, tags={})
    monitor.log_metrics({"loss": 1.0}, step=0)
    monitor.log_metrics({"loss": 0.5}, step=1)
    assert reader.get_metric_history(run_id, "loss") == []  # 2 of 3 steps: still buffered
    monitor.log_metrics({"loss": 0.25}, step=2)
    assert len(reader.get_metric_history(run_id, "loss")) == 3
    monitor.log_metrics({"loss": 0.125}, step=3)
    monitor.flush()
    assert len(reader.get_metric_history(run_id, "loss")) == 4
    monitor.finish("FAILED")
    assert reader.get_run(run_id).info.status == "FAILED"


def test_a_runs_monitor_logs_on_while_the_store_is_locked_and_loses_nothing(
    store: tuple[str, Path], reader: MlflowClient
):
    # Another writer holds the store's lock while training logs 12 steps (two sends due). A
    # monitor sending in the logging thread would wait out sqlite's busy timeout (5 s) and
    # raise "database is locked"; a run's monitor sends from its own thread, which waits for
    # the lock and sends once it is free.
    uri, root = store
    monitor = MLflowMonitor(uri, EXPERIMENT, flush_every=5, send_in_background=True)
    run_id = monitor.start({}, tags={})
    other = sqlite3.connect(root / "mlflow.db", isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        for step in range(12):
            monitor.log_metrics({"loss": reward_at(step), "kl": -reward_at(step)}, step)
    finally:
        other.execute("ROLLBACK")
        other.close()
    monitor.flush()  # waits for the send in flight, then sends the rest
    for key, sign in (("loss", 1), ("kl", -1)):
        history = reader.get_metric_history(run_id, key)
        assert sorted((m.step, m.value) for m in history) == [
            (s, sign * reward_at(s)) for s in range(12)
        ]
    monitor.finish()
    assert reader.get_run(run_id).info.status == "FINISHED"


def test_a_background_sends_error_is_raised_by_the_next_flush(store: tuple[str, Path]):
    monitor = MLflowMonitor(store[0], EXPERIMENT, flush_every=1, send_in_background=True)
    monitor.start({}, tags={})
    monitor.log_metrics({"k" * 300: 1.0}, step=0)  # MLflow refuses a key over 250 characters
    with pytest.raises(MlflowException, match="Metric name.*250"):
        monitor.flush()


def test_more_metrics_than_one_batch_allows_are_all_stored(
    store: tuple[str, Path], reader: MlflowClient
):
    monitor = MLflowMonitor(store[0], EXPERIMENT)
    run_id = monitor.start({}, tags={})
    # 1200 metrics in one step: above MLflow's 1000-per-log_batch limit, so two calls.
    monitor.log_metrics({f"staleness/bin_{i:04d}": float(i) for i in range(1200)}, step=0)
    monitor.finish()
    metrics = reader.get_run(run_id).data.metrics
    assert len(metrics) == 1200
    assert metrics["staleness/bin_1199"] == 1199.0


def test_artifact_lands_next_to_the_sqlite_store(store: tuple[str, Path], reader: MlflowClient):
    uri, root = store
    monitor = MLflowMonitor(uri, EXPERIMENT)
    run_id = monitor.start({}, tags={})
    report = root / "eval_report.json"
    report.write_text('{"accuracy": 0.5}')
    monitor.log_artifact(str(report))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        monitor.log_artifact(str(root / "missing.txt"))
    monitor.finish()
    assert [a.path for a in reader.list_artifacts(run_id)] == ["eval_report.json"]
    stored = list((root / "mlartifacts").rglob("eval_report.json"))
    assert [p.read_text() for p in stored] == ['{"accuracy": 0.5}']


def test_resuming_an_unknown_run_names_it(store: tuple[str, Path]):
    monitor = MLflowMonitor(store[0], EXPERIMENT, resume_run_id="0123456789abcdef")
    with pytest.raises(LookupError, match="0123456789abcdef"):
        monitor.start({}, tags={})


def test_logging_before_start_is_refused(store: tuple[str, Path]):
    monitor = MLflowMonitor(store[0], EXPERIMENT)
    with pytest.raises(RuntimeError, match="start"):
        monitor.log_metrics({"loss": 1.0}, step=0)
    monitor.finish()  # nothing started: cleanup paths may call it anyway


def test_default_tracking_uri(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert default_tracking_uri() == "http://127.0.0.1:5000"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"


def test_flatten_params_truncates_long_values_and_refuses_collisions():
    flat = flatten_params({"prompt": {"template": "x" * 10_000}, "empty": {}})
    assert len(flat["prompt.template"]) == PARAM_VALUE_MAX_CHARS
    assert flat["prompt.template"].endswith("[truncated]")
    assert flat["empty"] == "{}"
    with pytest.raises(ValueError, match="'a.b'"):
        flatten_params({"a.b": 1, "a": {"b": 2}})
