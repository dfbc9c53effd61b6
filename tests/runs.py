"""A whole run as a test starts it (`python -m relax_core.entrypoints.run`), with a deadline that
says where it waited: past the deadline every process of the run is asked for its threads' stacks
(SIGUSR1, relax_core/roles/stacks.py) before it is killed, and the test fails with them. A
process of the run that outlives it (found by `cfg`'s directory, which must be the test's own)
fails the test too."""

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


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _mentioning(text: str) -> list[int]:
    """Processes whose command line mentions `text` (a run's directory): the run's processes
    that left its tree (a rank whose torchrun ended)."""
    pids = [int(e) for e in os.listdir("/proc") if e.isdigit() and int(e) != os.getpid()]
    return [p for p in pids if any(text in a for a in _argv(p))]


def _ours(pid: int) -> bool:
    """A process of the run that dumps its stacks on SIGUSR1 (torchrun's own agent does not:
    the signal would end it)."""
    argv = _argv(pid)
    return "torch.distributed.run" not in argv and any(
        a.startswith("relax_core.entrypoints.") for a in argv
    )


def run_to_end(cfg: str, timeout_s: float, logs: str = ".relax") -> subprocess.CompletedProcess:
    """Run the config `cfg` in a child process and return it ended, its output beside `cfg`.
    Past `timeout_s` the test fails with the stacks of every process of the run, the run's
    stderr tail and the tails of the roles' logs (found under `logs`); it fails too when a
    process of the run (one whose command names `cfg`'s directory) outlives it."""
    where = os.path.dirname(os.path.abspath(cfg))
    paths = [os.path.join(where, f"run.{name}") for name in ("stdout", "stderr")]
    with open(paths[0], "w") as out, open(paths[1], "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
            stdout=out,
            stderr=err,
        )
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _dump_and_kill(list(dict.fromkeys(_tree(proc.pid) + _mentioning(where))))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=30)
        pytest.fail(
            f"the run did not end within {timeout_s:.0f} s; every process's stacks were asked "
            f"for (SIGUSR1)\n--- stderr\n{_read(paths[1])[-12000:]}\n{_log_tails(logs)}",
            pytrace=False,
        )
    stdout, stderr = _read(paths[0]), _read(paths[1])
    deadline = time.monotonic() + 10.0  # a rank the kernel is ending as torchrun exits
    while (left := [p for p in _mentioning(where) if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:  # only these: the run's own pid may belong to another process by now
        _dump_and_kill(left)
        pytest.fail(
            f"processes of the run outlived it: {[' '.join(_argv(p))[:200] for p in left]}\n"
            f"--- stderr\n{_read(paths[1])[-12000:]}",
            pytrace=False,
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie has)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except (OSError, IndexError):
        return False


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _dump_and_kill(pids: list[int]) -> None:
    """SIGUSR1 to each of the run's `pids` in turn (their stacks to their logs), then SIGKILL."""
    for pid in pids:
        if _ours(pid):  # one at a time: a trainer's ranks share one stderr
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
            time.sleep(0.5)
    time.sleep(2.0)  # the dumps reach stderr and the logs
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _log_tails(logs: str) -> str:
    tails = []
    for path in sorted(glob.glob(os.path.join(logs, "**", "*.log"), recursive=True)):
        tail = _read(path)[-3000:]
        if tail.strip():
            tails.append(f"--- {path}\n{tail}")
    return "\n".join(tails)
