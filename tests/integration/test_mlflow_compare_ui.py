"""The compare URL opens MLflow's compare page on the two runs, rendered by headless Chromium.

A real `mlflow server` (sqlite store) runs as a subprocess on a free loopback port; two runs are
logged to it over HTTP; Chromium loads `compare_url(...)` and dumps the DOM once the React app
has fetched its data. The DOM must show both runs' names, ids and logged keys: the page rendered
those runs, not just the app shell or an error.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from html import unescape
from pathlib import Path

# mlflow decides whether to start its telemetry client when it is imported, so this must come first.
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
from mlflow.tracking import MlflowClient

from relax_core.tracking.compare import compare_url
from tests import needs
from tests.s3servers import free_ports

pytestmark = [pytest.mark.slow, pytest.mark.integration]

CHROMIUM = "/usr/bin/chromium"
SERVER_START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
# Virtual time stands still while requests are in flight, so the budget is time for the app's
# timers after its fetches; the retry doubles it in case a slow machine needed more.
RENDER_BUDGETS_MS = (10_000, 20_000)
RENDER_TIMEOUT_S = 60.0
RUNS = {  # run name -> learning rate logged as param `optim.lr`
    "cpu-default-20261122-081500": "0.001",
    "cpu-default-20261122-093000": "0.003",
}


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """http URI of an `mlflow server` subprocess on a free port, stopped by PID on teardown."""
    if not os.access(CHROMIUM, os.X_OK):
        needs.missing(f"{CHROMIUM} is missing", "apt-get install chromium (.ci/run does)")
    (port,) = free_ports(1)
    uri = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "mlflow-server.log"
    command = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
        "--default-artifact-root", str(tmp_path / "art"),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--workers", "1",  # each worker imports mlflow: seconds of CPU apiece
    ]  # fmt: skip
    # The server's job runner (four huey consumer processes, each importing mlflow) serves
    # nothing the UI test uses.
    env = {
        **os.environ,
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    try:
        _wait_healthy(uri, server, log_path)
        yield uri
    finally:
        _stop_group(server)


def test_compare_url_renders_both_runs_in_the_mlflow_ui(mlflow_server: str, tmp_path: Path):
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.create_experiment("relax-compare-ui")
    run_ids = []
    for name, lr in RUNS.items():
        run_id = client.create_run(experiment_id, run_name=name).info.run_id
        client.log_param(run_id, "optim.lr", lr)
        for step in range(3):
            client.log_metric(run_id, "eval/accuracy", 0.2 * step + float(lr) * 100, step=step)
        client.set_terminated(run_id)
        run_ids.append(run_id)
    url = compare_url(mlflow_server, [experiment_id], run_ids)

    expected = [*RUNS, *run_ids, *RUNS.values(), "optim.lr", "eval/accuracy", "Comparing 2 Runs"]
    for attempt, budget_ms in enumerate(RENDER_BUDGETS_MS):
        text = _rendered_text(url, tmp_path / f"chromium-profile-{attempt}", budget_ms)
        missing = [item for item in expected if item not in text]
        if not missing:
            break
    assert not missing, f"compare page at {url} lacks {missing}; rendered text: {text[:2000]!r}"


def _rendered_text(url: str, profile: Path, budget_ms: int) -> str:
    """Visible text (tags stripped, whitespace collapsed) of `url` after Chromium renders it."""
    command = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}",
        "--dump-dom", url,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, timeout=RENDER_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"chromium exited {done.returncode}: {done.stderr[-2000:]!r}"
    dom = done.stdout.decode("utf-8", errors="replace")
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.DOTALL)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", dom)).split())


def _wait_healthy(uri: str, server: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"mlflow server exited {server.returncode}: {_tail(log_path)}")
        with (
            contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
            urllib.request.urlopen(f"{uri}/health", timeout=2) as response,
        ):
            if response.status == 200:
                return
        time.sleep(0.25)
    raise RuntimeError(
        f"mlflow server at {uri} did not answer /health in {SERVER_START_TIMEOUT_S:.0f}s: "
        f"{_tail(log_path)}"
    )


def _stop_group(process: subprocess.Popen) -> None:
    """SIGTERM the server's process group (it leads it), SIGKILL what is left after a timeout."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)
    # uvicorn's worker processes may outlive a parent that exited.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(STOP_TIMEOUT_S)


def _tail(path: Path) -> str:
    return path.read_bytes()[-4000:].decode("utf-8", errors="replace")
