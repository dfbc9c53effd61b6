"""Functions the isolation tests run inside pods (`pod_main call tests.rehearsal.probes:<fn>`).

They import nothing heavy, so a probe pod starts in well under a second.
"""

from __future__ import annotations

import os
import socket
import tempfile


def write_local(token: str) -> dict[str, object]:
    """Write `token` to every local place a task might use; returns the absolute paths written
    (cwd, HOME, TMPDIR, /tmp, /var/tmp, /dev/shm) and the places refused (the read-only root)."""
    places = {
        "cwd": os.getcwd(),
        "home": os.path.expanduser("~"),
        "tmpdir": tempfile.gettempdir(),
        "tmp": "/tmp",
        "var_tmp": "/var/tmp",
        "dev_shm": "/dev/shm",
        "root": "/",
    }
    written, refused = {}, {}
    for where, directory in places.items():
        path = os.path.join(directory, f"rehearsal-probe-{token}")
        try:
            with open(path, "w") as f:
                f.write(token)
            written[where] = os.path.abspath(path)
        except OSError as exc:
            refused[where] = f"{type(exc).__name__}: {exc.strerror}"
    return {"written": written, "refused": refused}


def read_local(paths: dict[str, str], token: str) -> dict[str, bool]:
    """For each path, whether it exists here holding `token`."""
    found = {}
    for where, path in paths.items():
        try:
            with open(path) as f:
                found[where] = f.read() == token
        except OSError:
            found[where] = False
    return found


def whoami() -> dict[str, object]:
    """What the pod is told and sees of itself: its name, the address its hostname resolves
    to (how the trainer finds its pod address), its PID and the environment's RELAX_POD_IP."""
    name = socket.gethostname()
    return {
        "hostname": name,
        "resolves_to": socket.gethostbyname(name),
        "pod_ip": os.environ.get("RELAX_POD_IP", ""),
        "pid": os.getpid(),
        "home": os.path.expanduser("~"),
        "tmpdir": tempfile.gettempdir(),
    }


def can_connect(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connection to host:port opens from this pod."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False
