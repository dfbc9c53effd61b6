"""Many stand-in SGLang servers from one start (`fake_sglang --port P --more-ports Q R ...`).

A stand-in server takes seconds to import torch and build its policy on 2 cores; a test that
needs more servers than the weight sender has threads (17 and up) would spend a minute starting
them. Here one process loads the policy once and forks one server per port, each a process of
its own with its own weights, weight group and scheduler, as separate SGLang servers are.

A server whose process dies (a test kills the pid that `GET /relax_test/pid` names) is forked
again on its port: a restarted server, as a sidecar restarted by its kubelet is, holding its
launch weights and version and no weight group.
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def run_fleet(ports: list[int], serve_one: Callable[[int], None]) -> None:
    """Fork `serve_one(port)` for each port and fork it again whenever it dies; never returns.
    Call it before any thread starts (fork copies only the calling thread)."""
    children: dict[int, int] = {}

    def spawn(port: int) -> None:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:  # the servers go with this process, however it ends
                ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
                serve_one(port)
                code = 0
            finally:
                os._exit(code)
        children[pid] = port

    for port in ports:
        spawn(port)
    while True:
        pid, _ = os.wait()
        port = children.pop(pid, None)
        if port is not None:
            spawn(port)
