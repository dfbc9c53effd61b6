"""Write the empty MLflow sqlite store that new local stores start from
(relax_core/tracking/templates/mlflow-<version>.sqlite.gz), for the mlflow installed here.

MLflow builds a new sqlite store by running every one of its schema migrations, 1.3 s of Python
on a 2-core machine, the first time anything opens it. The template is that result, made by
MLflow itself: a store MLflow created and migrated, with the Default experiment it then adds
taken out again (its artifact location names this script's scratch directory; MLflow adds it back,
with the right location, when a store made from the template is first opened). Run this after
changing mlflow's pin; tests/integration/test_mlflow_store_template.py fails until then.

    python scripts/mlflow_store_template.py
"""

from __future__ import annotations

import gzip
import os
import shutil
import sqlite3
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from relax_core.tracking.store import template_path  # noqa: E402


def build(out: str) -> None:
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    with tempfile.TemporaryDirectory() as tmp:
        db = os.path.join(tmp, "mlflow.db")
        store = SqlAlchemyStore(f"sqlite:///{db}", os.path.join(tmp, "artifacts"))
        store.engine.dispose()
        con = sqlite3.connect(db)
        con.execute("DELETE FROM experiment_tags")
        con.execute("DELETE FROM experiments")
        con.commit()
        con.execute("VACUUM")
        con.close()
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with (
            open(db, "rb") as src,
            open(out + ".tmp", "wb") as raw,
            gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz,
        ):
            shutil.copyfileobj(src, gz)
        os.replace(out + ".tmp", out)


if __name__ == "__main__":
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    from importlib.metadata import version

    path = template_path(version("mlflow"))
    build(path)
    print(f"wrote {os.path.relpath(path, REPO)} ({os.path.getsize(path)} bytes)")
