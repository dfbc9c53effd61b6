"""Shared test setup: quiet, offline, and every temp file under the test's own directory."""

from __future__ import annotations

import http.server
import json
import os
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests import s3servers  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_collection_modifyitems(config, items):
    _slowest_files_first(items)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _slowest_files_first(items) -> None:
    """Order the test files by their measured time, slowest first (tests/file_times.json,
    written by scripts/durations.py --write; a file it does not know yet goes first), each
    file's tests kept together and in order. scripts/test.sh hands whole files to the workers
    in this order (--dist loadfile --no-loadscope-reorder), so the long runs start early and
    the last minutes are not one heavy file on one worker while the other idles."""
    try:
        with open(os.path.join(REPO, "tests", "file_times.json")) as f:
            seconds = json.load(f)
    except (OSError, ValueError):
        return
    first = float("inf")

    def weight(item) -> float:
        path = os.path.relpath(str(item.path), REPO)
        return -seconds.get(path, first)

    items.sort(key=weight)


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """A test past its bound (pytest-timeout, `timeout` in pyproject.toml) fails with what it
    waited on: its own threads' stacks (pytest's traceback) and every child process with the
    stacks of those that dump them (tests/runs.py). Elsewhere pytest-timeout's own timer runs."""
    if settings.method != "signal" or threading.current_thread() is not threading.main_thread():
        return None
    from tests.runs import stacks_of_children

    def on_timeout(signum, frame):
        __tracebackhide__ = True
        signal.setitimer(signal.ITIMER_REAL, 0)
        pytest.fail(stacks_of_children(settings.timeout), pytrace=True)

    def cancel():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)

    item.cancel_timeout = cancel
    signal.signal(signal.SIGALRM, on_timeout)
    signal.setitimer(signal.ITIMER_REAL, settings.timeout)
    return True


@pytest.fixture(autouse=True)
def process_state_kept():
    """What a test changes in its worker process does not reach the next test: the environment
    (a run's AWS credentials, the MASTER_PORT an in-process trainer sets), torch's thread count
    and deterministic kernels (a run sets train.torch_threads and train.deterministic)."""
    import torch
    import torch.utils.deterministic

    env = dict(os.environ)
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def _enter_workdir(path, monkeypatch) -> None:
    """Make `path` a run's directory (the repo's datasets/ seen from it, flytekit's temp files
    in its tmp/) and the current one, through `monkeypatch`."""
    os.symlink(os.path.join(REPO, "datasets"), path / "datasets")
    tmp = path / "tmp"
    tmp.mkdir()
    monkeypatch.chdir(path)
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """Run in a fresh directory that sees the repo's datasets/ and keeps flytekit's temp files."""
    _enter_workdir(tmp_path, monkeypatch)
    return tmp_path


def workdir_for(factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """`workdir` for a module-scoped fixture: a fresh directory, current while the caller's
    `for` lasts."""
    path = factory.mktemp(name)
    with pytest.MonkeyPatch.context() as mp:
        _enter_workdir(path, mp)
        yield path


SMALL_RUN = {
    "run_name": "t",
    "seed": 0,
    "model": {
        "kind": "tiny-qwen3",
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 2,
        "num_kv_heads": 1,
        "intermediate_size": 64,
    },
    "warm_start": {"steps": 5, "lr": 0.003, "batch_size": 16},
    "data": {"eval_size": 16},
    "rollout": {"n_samples_per_prompt": 4, "groups_per_step": 4, "max_new_tokens": 4},
    "train": {
        "total_steps": 6,
        "checkpoint_every": 2,
        "steps_per_node": 3,
        "torch_threads": 1,
        "keep_checkpoints": 10,
    },
    "tracking": {"experiment": "tests", "progress": False},
}


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base.get(key, {}), value) if isinstance(value, dict) else value
    return out


@pytest.fixture
def small_config(workdir):
    """Write a small, fast run config into the work dir; keyword sections override SMALL_RUN."""

    def write(name: str = "run.yaml", **sections) -> str:
        return write_small_config(workdir, name, **sections)

    return write


def write_small_config(where, name: str, **sections) -> str:
    """SMALL_RUN under `sections`, tracked in `where`/mlflow.db, written to `where`/`name`."""
    import yaml

    data = _merge(SMALL_RUN, sections)
    data.setdefault("tracking", {})["tracking_uri"] = f"sqlite:///{where}/mlflow.db"
    path = where / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _s3_server(start, *args):
    # A missing server fails rather than skips: CI installs both (the `dev` extra), and a
    # skipped storage test would let a queue regression on real S3 pass unseen.
    server = start(*args)
    try:
        yield server
    finally:
        server.stop()


# The S3 servers start once per test process (an xdist worker) and are shared by every test
# file it runs: each test writes under a key prefix of its own and never assumes an empty bucket.
# A test that crashes a server (server.crash()) restarts it before it ends.


@pytest.fixture(scope="session")
def moto_s3(tmp_path_factory):
    """A moto S3 server (tests/s3servers.py), with the bucket `queue-bucket`."""
    yield from _s3_server(s3servers.start_moto, str(tmp_path_factory.mktemp("moto")))


@pytest.fixture(scope="session")
def seaweed_s3(tmp_path_factory):
    """A SeaweedFS (`weed mini`) S3 server, with the bucket `queue-bucket`."""
    yield from _s3_server(s3servers.start_seaweedfs, str(tmp_path_factory.mktemp("seaweed")))


@pytest.fixture
def hook():
    """A JSON webhook on 127.0.0.1 recording what it receives; yields (url, received)."""
    received: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            received.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"json://127.0.0.1:{server.server_port}/hook", received
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def cpu_default_policies(tmp_path_factory) -> tuple[str, str]:
    """(cache dir, policy dir): the CPU default's warm-started policy, prepared once for the
    session's workers (tests/policies.py); a test sets `checkpoint.policy_cache_dir` to it."""
    from tests.policies import cpu_default_policies

    return cpu_default_policies(tmp_path_factory)
