"""Network helpers shared by the parts that start servers or rendezvous points."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
