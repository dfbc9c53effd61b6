"""Network helpers shared by the parts that start servers or rendezvous points."""

from __future__ import annotations

import os
import socket


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


POD_IP_ENV = "RELAX_POD_IP"
"""The pod's address, as Kubernetes' downward API gives it (status.podIP)."""


def pod_address() -> str:
    """The address other pods reach this one at: $RELAX_POD_IP, else what the hostname
    resolves to (a Kubernetes pod's hostname resolves to its pod IP)."""
    return os.environ.get(POD_IP_ENV) or socket.gethostbyname(socket.gethostname())
