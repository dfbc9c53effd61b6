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
import threading
import time
import traceback

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
    """A process that dumps its stacks on SIGUSR1 (relax_core/roles/stacks.py): it catches the
    signal. One that does not (torchrun's own agent, a server) would be ended by it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    except (OSError, StopIteration, IndexError):
        return False
    return bool(int(caught, 16) >> (signal.SIGUSR1 - 1) & 1) and "python" in (_argv(pid) or [""])[0]


def stacks_of_children(timeout_s: float) -> str:
    """What a test that ran past its bound (`timeout_s`, pytest-timeout) was waiting on: every
    descendant of this process with its command line, and for those that dump their stacks on
    SIGUSR1 (a run's roles, its supervisor, a trainer's ranks) the stacks, read back from their
    stderr where that is a file (a run's logs). Nothing is killed: the test's own teardown
    stops what it started."""
    pids = [p for p in _tree(os.getpid()) if p != os.getpid() and running(p)]
    asked = _ask_for_stacks(pids)
    lines = [f"the test ran past its bound of {timeout_s:.0f} s (pytest-timeout)"]
    here = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident != here:
            lines.append(f"--- its thread {ident}\n{''.join(traceback.format_stack(frame))}")
    lines.append(f"its processes ({len(pids)}):")
    for pid in pids:
        lines.append(f"  {pid}: {' '.join(_argv(pid))[:300]}")
    for pid in asked:
        with contextlib.suppress(OSError):
            err = os.readlink(f"/proc/{pid}/fd/2")
            if os.path.isfile(err):
                lines.append(
                    f"--- stderr of {pid} ({err}), ending with its stacks\n{_read(err)[-6000:]}"
                )
    return "\n".join(lines)


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


def _ask_for_stacks(pids: list[int]) -> list[int]:
    """SIGUSR1 to each of `pids` that dumps its stacks on it, one at a time (a trainer's ranks
    share one stderr), and time for the dumps to reach stderr and the logs; those asked."""
    asked = [pid for pid in pids if _ours(pid)]
    for pid in asked:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)
    if asked:
        time.sleep(2.0)
    return asked


def _dump_and_kill(pids: list[int]) -> None:
    """The stacks of the run's `pids` to their logs (_ask_for_stacks), then SIGKILL."""
    _ask_for_stacks(pids)
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


RUN_TIMEOUT_S = 270.0
"""run_small's deadline: one small run took 40-180 s on a 2-core machine under a load of 5 to 20;
past it the test fails with its processes' stacks, before pytest-timeout's bound (300 s)."""


def run_small(workdir, name: str, timeout_s: float = RUN_TIMEOUT_S, **sections) -> str:
    """Run a small config (tests/conftest.py's SMALL_RUN under `sections`) written to
    `workdir`/`name` to its end, with run_to_end's deadline; returns the run's stderr, kept
    beside the config as <name>.stderr (and stdout as <name>.stdout)."""
    from tests.conftest import write_small_config

    cfg = write_small_config(workdir, name, **sections)
    out = run_to_end(cfg, timeout_s=timeout_s)
    for stream in ("stdout", "stderr"):  # kept per run: the next run's would overwrite them
        os.replace(os.path.join(workdir, f"run.{stream}"), os.path.splitext(cfg)[0] + f".{stream}")
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
    return out.stderr


def wait_until(condition, what: str, timeout_s: float = 60.0, every_s: float = 0.05) -> None:
    """Poll `condition` every `every_s` until it holds; fail naming `what` did not happen
    within `timeout_s` (a loaded 2-core machine's bound, far above what it needs)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(every_s)
