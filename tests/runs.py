"""A whole run as a test starts it (`python -m relax_core.entrypoints.run`), with a deadline that
says where it waited: past the deadline every process of the run is asked for its threads' stacks
(SIGUSR1, relax_core/roles/stacks.py) before it is killed, and the test fails with them."""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time

import pytest


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _ours(pid: int) -> bool:
    """A process of the run that dumps its stacks on SIGUSR1 (torchrun's own agent does not:
    the signal would end it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return "torch.distributed.run" not in argv and any(
        a.startswith("relax_core.entrypoints.") for a in argv
    )


def run_to_end(cfg: str, timeout_s: float, logs: str = ".relax") -> subprocess.CompletedProcess:
    """Run the config `cfg` in a child process and return it ended. Past `timeout_s` the test
    fails with the stacks of every process of the run, the run's stderr tail and the tails of
    the roles' logs (found under `logs`)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        pass
    tree = _tree(proc.pid)
    for pid in tree:
        if _ours(pid):  # one at a time: a trainer's ranks share one stderr
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
    time.sleep(2.0)  # the dumps reach stderr and the logs
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    out, err = proc.communicate()
    tails = []
    for path in sorted(glob.glob(os.path.join(logs, "**", "*.log"), recursive=True)):
        with open(path, errors="replace") as f:
            tail = f.read()[-3000:]
        if tail.strip():
            tails.append(f"--- {path}\n{tail}")
    pytest.fail(
        f"the run did not end within {timeout_s:.0f} s; every process's stacks were asked for "
        f"(SIGUSR1)\n--- stderr\n{err[-12000:]}\n" + "\n".join(tails),
        pytrace=False,
    )
