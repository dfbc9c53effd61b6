"""New local MLflow stores start from the empty store shipped for the pinned mlflow
(relax_core/tracking/templates), and are then the same as a store MLflow migrates itself."""

import gzip
import os
import re
import sqlite3
from importlib.metadata import version
from pathlib import Path

# mlflow decides whether to start its telemetry client when it is imported, so this must come first.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
from mlflow.tracking import MlflowClient

from relax_core.tracking.mlflow_monitor import MLflowMonitor
from relax_core.tracking.store import seed_sqlite_store, template_path

REPO = Path(__file__).resolve().parents[2]


def schema(db: Path) -> tuple[list[tuple], list[tuple]]:
    """(every table, index and trigger with the lines of its SQL; the alembic revision).

    The lines are sorted: MLflow's migrations rebuild tables with their constraints in an
    order that varies from one Python process to the next (set order), so two stores it
    migrated itself differ in the order of a table's CHECK lines, and nothing else.
    """
    con = sqlite3.connect(db)
    try:
        objects = [
            (
                kind,
                name,
                table,
                sorted(line.strip().rstrip(",") for line in (sql or "").split("\n")),
            )
            for kind, name, table, sql in con.execute(
                "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
            )
        ]
        return objects, con.execute("SELECT version_num FROM alembic_version").fetchall()
    finally:
        con.close()


def rows(db: Path, table: str) -> list[tuple]:
    con = sqlite3.connect(db)
    try:
        return con.execute(f"SELECT * FROM {table}").fetchall()
    finally:
        con.close()


def test_the_pinned_mlflow_has_a_template():
    pin = re.search(r'"mlflow==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version("mlflow") == pin
    assert os.path.exists(template_path(pin)), (
        f"no empty store for mlflow {pin}: run `python scripts/mlflow_store_template.py`"
    )


def test_the_template_is_the_store_mlflow_migrates_to(tmp_path: Path):
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    migrated = tmp_path / "migrated.db"
    SqlAlchemyStore(f"sqlite:///{migrated}", str(tmp_path / "artifacts")).engine.dispose()
    shipped = tmp_path / "shipped.db"
    with gzip.open(template_path(version("mlflow")), "rb") as src:
        shipped.write_bytes(src.read())
    assert schema(shipped) == schema(migrated)
    # MLflow adds its Default experiment on first open, with that store's artifact location.
    assert rows(shipped, "experiments") == []
    assert len(rows(migrated, "experiments")) == 1


def test_a_run_in_a_seeded_store_reads_back_like_one_in_a_store_mlflow_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    stores = {}
    for name, seed in (("seeded", True), ("made", False)):
        (tmp_path / name).mkdir()
        uri = f"sqlite:///{tmp_path / name / 'mlflow.db'}"
        if not seed:
            MlflowClient(uri).search_experiments()  # MLflow creates and migrates it
        monitor = MLflowMonitor(uri, "exp", run_name="r")
        monitor.start({"lr": 0.1}, {"kind": "test"})
        monitor.log_metrics({"loss": 0.5}, step=1)
        monitor.finish()
        stores[name] = uri
    assert not any(p.name.startswith("mlflow.db.seed") for p in (tmp_path / "seeded").iterdir())

    def summary(uri: str):
        client = MlflowClient(uri)
        experiments = sorted(
            (e.experiment_id, e.name, e.artifact_location.replace(str(Path(uri[10:]).parent), "D"))
            for e in client.search_experiments()
        )
        run = client.search_runs(["1"])[0]
        return experiments, run.data.params, run.data.metrics, run.info.status

    assert summary(stores["seeded"]) == summary(stores["made"])
    # The Default experiment points where MLflow would have put it: ./mlruns of the CWD.
    default = MlflowClient(stores["seeded"]).get_experiment("0")
    assert default.artifact_location == str(tmp_path / "mlruns" / "0")


def test_only_a_new_sqlite_store_of_a_known_mlflow_is_seeded(tmp_path: Path):
    existing = tmp_path / "existing.db"
    existing.write_bytes(b"")
    assert not seed_sqlite_store(f"sqlite:///{existing}")
    assert existing.read_bytes() == b""  # an empty file is MLflow's to decide on
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'no' / 'such' / 'dir.db'}")
    assert not (tmp_path / "no").exists()
    assert not seed_sqlite_store("http://127.0.0.1:5000")
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'other.db'}", mlflow_version="0.0.1")
    assert not (tmp_path / "other.db").exists()
    assert seed_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}")
    assert not seed_sqlite_store(f"sqlite:///{tmp_path / 'new.db'}")  # it exists now
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing.db", "new.db"]
