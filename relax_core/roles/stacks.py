"""Where a stuck process waits: after `dump_stacks_on_signal()`, `kill -USR1 <pid>` writes every
thread's stack to the process's stderr (a role's log) and the process goes on. Every role, the
trainer's other ranks and the local supervisor (`relax_core.entrypoints.run`) turn it on."""

from __future__ import annotations

import faulthandler
import signal


def dump_stacks_on_signal() -> None:
    """From now on SIGUSR1 writes every thread's stack to stderr without stopping the process."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
