"""Where a run's MLflow store is when the config names none (no mlflow import: it takes seconds)."""

from __future__ import annotations

import os
from pathlib import Path


def default_tracking_uri(cwd: str | None = None) -> str:
    """MLFLOW_TRACKING_URI when set, else a sqlite store `mlflow.db` in `cwd` (default: the CWD).

    The sqlite path is made absolute so the URI still names the same store after a chdir.
    """
    from_env = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if from_env:
        return from_env
    db = Path(cwd or os.getcwd()).resolve() / "mlflow.db"
    return f"sqlite:///{db}"
