"""Preemption: SIGTERM asks the step loop for a checkpoint at the next step boundary.

Kubernetes sends SIGTERM before it stops a pod (a spot node going away, a drained node, a
deleted execution) and SIGKILL after the pod's grace period. By default SIGTERM ends the process
and loses every step since the last checkpoint; inside `checkpoint_on_sigterm()` it only sets a
flag. The loop (loop.py) asks `requested()` after each step: it then logs and flushes that step,
saves a checkpoint and raises `Preempted`, which names it. Code that waits inside a step for its
inputs (the async trainer waiting for ready groups) raises `Interrupted` when asked before it
has taken anything; the loop treats that as a step boundary too. A second SIGTERM ends the
process at once, as without the handler.

The grace period a pod needs is therefore one step plus one checkpoint write (docs/operations.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

EXIT_CODE = 128 + signal.SIGTERM
"""What a preempted process exits with (the shell's code for death by SIGTERM)."""

_requested = threading.Event()


class Preempted(Exception):
    """The loop stopped on SIGTERM after writing `checkpoint` (policy version `version`)."""

    def __init__(self, checkpoint: str, version: int) -> None:
        super().__init__(
            f"preempted (SIGTERM): checkpoint of policy version {version} written at "
            f"{checkpoint}; run again with checkpoint.resume: true to continue from it"
        )
        self.checkpoint = checkpoint
        self.version = version


class Interrupted(Exception):
    """Raised inside a step that was asked to stop before it took any input."""


def requested() -> bool:
    return _requested.is_set()


@contextlib.contextmanager
def checkpoint_on_sigterm() -> Iterator[None]:
    """Within: SIGTERM sets the flag instead of ending the process. On the main thread only
    (elsewhere handlers cannot be set and the caller's stay)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def on_sigterm(signum: int, _frame: object) -> None:
        if _requested.is_set():  # asked twice: do what SIGTERM does without us
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        log.warning("SIGTERM: writing a checkpoint at the end of this step, then stopping")
        _requested.set()

    _requested.clear()  # before this, SIGTERM ended the process: nothing can be pending
    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _requested.clear()
