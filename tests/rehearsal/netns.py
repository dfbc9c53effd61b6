"""Network namespaces for the rehearsal: a private switch and one namespace per host.

    with open_network("rh") as net:          # Network, or LoopbackNetwork where it cannot be made
        storage = net.add_host("storage")    # Host(name, netns, ip)
        subprocess.run([*net.exec_prefix(storage), "ip", "addr"])
        net.runner(storage).call(fn)         # fn runs with the host's network

A "switch" namespace holds a Linux bridge; each host is a namespace joined to it by a veth pair
(`eth0` inside, `v<k>` on the bridge) with an address from a random private /24 that the machine
does not route, and `lo` up. Everything is created inside the test's own namespaces (veth pairs
are made in the switch namespace and their peer moved straight into the host's), so nothing in
the root namespace changes and no traffic leaves the bridge. Names carry a prefix, the creating
PID and a random tag; the context manager removes every namespace (and with them every link) at
the end, also on failure, and a later Network sweeps namespaces whose creator has died.

`available()` says whether namespaces can be made here (root, iproute2, a kernel that lets us);
`open_network` falls back to LoopbackNetwork (every host 127.0.0.1, no prefix) with a warning,
also when RELAX_REHEARSAL_ISOLATION=off.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import os
import random
import re
import secrets
import shutil
import subprocess
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tests.needs import in_ci

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
ISOLATION_ENV = "RELAX_REHEARSAL_ISOLATION"
NETNS_DIR = "/run/netns"
_STALE_NAME = re.compile(r"^(?P<prefix>[a-z]+)(?P<pid>\d+)x[0-9a-f]{4}-")


class IsolationUnavailable(UserWarning):
    """The rehearsal runs without namespaces; what it proves is weaker (see the message)."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str | None
    """The namespace's name under /run/netns; None on the loopback fallback."""
    ip: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def available() -> tuple[bool, str]:
    """(True, "") when this process can build the network, else (False, why not)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "network namespaces need root (this process is not root)"
    for exe in ("ip", "unshare"):
        if shutil.which(exe) is None:
            return False, f"`{exe}` is not on PATH (iproute2 / util-linux)"
    probe = f"rhprobe{os.getpid()}x{secrets.token_hex(2)}"
    try:
        for args in (
            ("netns", "add", probe),
            ("-n", probe, "link", "add", "br0", "type", "bridge"),
            ("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1"),
        ):
            done = _ip(*args, check=False)
            if done.returncode != 0:
                return False, f"`ip {' '.join(args)}` failed: {done.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return True, ""


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 prefix the machine has an address on or a route to (any routing table)."""
    nets = []
    for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        done = _ip(*args, check=False)
        for token in done.stdout.split():
            with contextlib.suppress(ValueError):
                if token[0].isdigit() and ("/" in token or token.count(".") == 3):
                    nets.append(ipaddress.IPv4Network(token, strict=False))
    return nets


def pick_subnet(rng: random.Random | None = None) -> ipaddress.IPv4Network:
    """A random 10.R.S.0/24 that overlaps nothing the machine routes."""
    rng = rng or random.Random()
    taken = _routed_networks()
    for _ in range(1000):
        net = ipaddress.IPv4Network(f"10.{rng.randrange(16, 250)}.{rng.randrange(1, 255)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("found no unrouted 10.x.y.0/24 for the rehearsal network")


def sweep_stale(prefix: str) -> list[str]:
    """Delete namespaces named by an earlier Network with `prefix` whose creator has died (a test
    killed before its cleanup ran); returns their names."""
    done = _ip("netns", "list", check=False)
    removed = []
    for line in done.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _STALE_NAME.match(name)
        if not match or match["prefix"] != prefix:
            continue
        pid = int(match["pid"])
        if pid == os.getpid() or os.path.exists(f"/proc/{pid}"):
            continue
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


class NamespaceRunner:
    """Runs callables with a namespace's network, from a thread that joined it (setns applies
    to the calling thread only, and threads it starts inherit it). `loop` is an asyncio loop in
    that thread for clients that open sockets from their own loop (s3fs: pass `loop=`)."""

    def __init__(self, netns: str) -> None:
        self.netns = netns
        self.loop = asyncio.new_event_loop()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name=f"netns-{netns}", daemon=True)
        self._thread.start()
        self._ready.result(timeout=30)

    def _main(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(os.path.join(NETNS_DIR, self.netns), os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({self.netns}): {os.strerror(err)}")
            finally:
                os.close(fd)
        except BaseException as exc:
            self._ready.set_exception(exc)
            return
        asyncio.set_event_loop(self.loop)
        self._ready.set_result(None)
        self.loop.run_forever()

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 120.0) -> T:
        """fn(*args) on an executor thread of the namespace's loop (so fn may use the loop)."""

        async def run() -> T:
            return await self.loop.run_in_executor(None, fn, *args)

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class Network:
    """A bridge in its own namespace and one namespace per host; see the module docstring."""

    isolated = True

    def __init__(self, prefix: str = "rh") -> None:
        if not prefix.isalpha() or not prefix.islower():
            raise ValueError(f"prefix must be lowercase letters, got {prefix!r}")
        self.prefix = prefix
        self.tag = f"{prefix}{os.getpid()}x{secrets.token_hex(2)}"
        self.subnet: ipaddress.IPv4Network | None = None
        self.switch = f"{self.tag}-sw"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        self._runners: dict[str, NamespaceRunner] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Network:
        sweep_stale(self.prefix)
        try:
            self.subnet = pick_subnet()
            self._add_namespace(self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        self._namespaces.append(name)  # first: close() removes it even if `add` half-failed
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")

    def add_host(self, name: str) -> Host:
        """A new namespace on the bridge with the next free address of the subnet."""
        if self.subnet is None:
            raise RuntimeError("use the Network as a context manager")
        addresses = list(self.subnet.hosts())
        with self._lock:  # pods of a dynamic start from several threads
            k = len(self.hosts) + 1
            if k >= len(addresses):
                raise RuntimeError(f"the rehearsal network {self.subnet} is full ({k - 1} hosts)")
            ns = f"{self.tag}-{k}"
            ip = str(addresses[k])  # addresses[0] (.1) is left unused: there is no gateway
            host = Host(name, ns, ip)
            self.hosts.append(host)
            self._add_namespace(ns)
        port = f"v{k}"
        _ip("-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{ip}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return host

    def exec_prefix(self, host: Host) -> list[str]:
        """The command prefix that runs a command with `host`'s network."""
        return ["ip", "netns", "exec", host.netns] if host.netns else []

    def runner(self, host: Host) -> NamespaceRunner:
        with self._lock:
            if host.netns not in self._runners:
                self._runners[host.netns] = NamespaceRunner(host.netns)
            return self._runners[host.netns]

    def close(self) -> None:
        """Remove every namespace this network made (their links go with them); idempotent."""
        for runner in self._runners.values():
            runner.close()
        self._runners.clear()
        errors = []
        for ns in reversed(self._namespaces):
            done = _ip("netns", "del", ns, check=False)
            if done.returncode != 0 and "No such file" not in done.stderr:
                errors.append(f"{ns}: {done.stderr.strip()}")
        self._namespaces.clear()
        if errors:
            raise RuntimeError("could not remove namespaces: " + "; ".join(errors))


class _DirectRunner:
    """NamespaceRunner's interface on the loopback fallback: calls run here."""

    loop = None

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 120.0) -> T:
        return fn(*args)

    def close(self) -> None:
        pass


class LoopbackNetwork:
    """The fallback: every host is this machine's 127.0.0.1 and nothing is isolated."""

    isolated = False

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.hosts: list[Host] = []
        self.subnet = None

    def __enter__(self) -> LoopbackNetwork:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def add_host(self, name: str) -> Host:
        host = Host(name, None, "127.0.0.1")
        self.hosts.append(host)
        return host

    def exec_prefix(self, host: Host) -> list[str]:
        return []

    def runner(self, host: Host) -> _DirectRunner:
        return _DirectRunner()

    def close(self) -> None:
        pass


def open_network(prefix: str = "rh") -> Network | LoopbackNetwork:
    """A Network where namespaces can be made; else LoopbackNetwork, said out loud (a warning
    and a printed line), since a rehearsal on loopback does not prove the pods isolated. Under
    CI=true a missing isolation raises IsolationUnavailable instead.
    RELAX_REHEARSAL_ISOLATION=off asks for the fallback (to check it, or to debug a pod)."""
    if os.environ.get(ISOLATION_ENV, "").lower() == "off":
        ok, reason = False, f"turned off by {ISOLATION_ENV}=off"
    else:
        ok, reason = available()
    if ok:
        return Network(prefix)
    if in_ci() and os.environ.get(ISOLATION_ENV, "").lower() != "off":
        raise IsolationUnavailable(
            f"CI=true, and the pod rehearsal cannot isolate its pods: {reason}. CI runs as root "
            "with iproute2; a rehearsal on loopback would pass without proving the pods isolated."
        )
    message = (
        f"pod rehearsal WITHOUT network or mount isolation: {reason}. Pods run as plain "
        "processes on 127.0.0.1 with their own HOME, TMPDIR and repo copy, so a local path "
        "handed between tasks is still caught, but not one under a shared absolute directory."
    )
    print(f"WARNING: {message}", flush=True)
    warnings.warn(message, IsolationUnavailable, stacklevel=2)
    return LoopbackNetwork(reason)
