"""Where a run's MLflow store is when the config names none, and how a new local store starts
(no mlflow import here: it takes seconds)."""

from __future__ import annotations

import contextlib
import gzip
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parent / "templates"
"""Empty sqlite stores as MLflow's migrations leave them, one per mlflow version
(scripts/mlflow_store_template.py writes them)."""


def default_tracking_uri(cwd: str | None = None) -> str:
    """MLFLOW_TRACKING_URI when set, else a sqlite store `mlflow.db` in `cwd` (default: the CWD).

    The sqlite path is made absolute so the URI still names the same store after a chdir.
    """
    from_env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if from_env:
        return from_env
    db = Path(cwd or os.getcwd()).resolve() / "mlflow.db"
    return f"sqlite:///{db}"


def template_path(mlflow_version: str) -> str:
    return str(TEMPLATES / f"mlflow-{mlflow_version}.sqlite.gz")


def seed_sqlite_store(tracking_uri: str, mlflow_version: str | None = None) -> bool:
    """Start a sqlite store that does not exist yet from the empty store of this mlflow version,
    instead of MLflow running all its schema migrations on first open (1.3 s on 2 cores).

    Whether it did: not for other stores, a file that exists (even empty: MLflow decides what
    it holds), a directory that does not, or an mlflow version without a template. The file
    appears whole or not at all (a hard link of a finished copy), so a process opening the
    store meanwhile never reads half of it, and one that created it first keeps its own.
    """
    if not tracking_uri.startswith("sqlite:///"):
        return False
    path = tracking_uri.removeprefix("sqlite:///").split("?", 1)[0]
    if (
        path in ("", ":memory:")
        or os.path.exists(path)
        or not os.path.isdir(os.path.dirname(path) or ".")
    ):
        return False
    if mlflow_version is None:
        try:
            mlflow_version = version("mlflow")
        except PackageNotFoundError:
            return False
    template = template_path(mlflow_version)
    if not os.path.exists(template):
        return False
    staging = f"{path}.seed-{os.getpid()}"
    try:
        with gzip.open(template, "rb") as src, open(staging, "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.link(staging, path)
    except FileExistsError:
        return False  # another process created the store first
    except OSError:
        return False  # no hard links here: MLflow creates the store itself
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(staging)
    return True
