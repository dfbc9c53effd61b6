"""A trainer rank under torchrun ends when torchrun ends.

torchrun starts each rank in a session of its own, so the signal the supervisor sends to the
trainer it started (torchrun's process group) never reaches the ranks: a trainer killed as
silent, or one whose start timed out, left its ranks running, an old rank 0 training beside the
trainer that replaced it, holding the run's console and a core each. `die_with_torchrun()` has
the kernel SIGKILL this process when its parent (torchrun) ends, however it ends (Linux's
PR_SET_PDEATHSIG); torchrun's own SIGTERM handling still ends ranks gracefully before that.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""prctl option (linux/prctl.h): the signal this process gets when its parent ends."""


def under_torchrun() -> bool:
    """Whether torchrun started this process (it sets TORCHELASTIC_RUN_ID for its ranks)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def _parent_is_torch_launcher() -> bool:
    """Whether the parent's command names torch (`torchrun`, `python -m torch.distributed.run`);
    a process adopted after its launcher ended has init or a container's reaper instead."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            return b"torch" in f.read()
    except OSError:
        return False


def die_with_torchrun() -> None:
    """Under torchrun on Linux: be SIGKILLed when torchrun ends; exit now if it already has
    (this process then belongs to whoever adopted it). Elsewhere nothing."""
    if not under_torchrun() or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # no prctl: torchrun's own handling is all there is
    if not _parent_is_torch_launcher():  # it ended before the line above
        print("torchrun, which started this rank, has ended: exiting", file=sys.stderr)
        os._exit(1)
