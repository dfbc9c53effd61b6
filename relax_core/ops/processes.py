"""The processes of a local async run: what each role's process is and records, the command that
starts it, the services a config runs, and the signals and logs the supervisor uses on them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from relax_core.config import RunConfig
from relax_core.queue import StorageUnavailable
from relax_core.roles.service import stage_chain
from relax_core.train.agent_failures import AgentsFailed

TAIL_LINES = 40


@dataclass
class RoleProcess:
    role: str
    worker: int
    log_path: str
    incarnation: int = 0
    pid: int = 0
    exit_code: int | None = None
    cpu_s: float = 0.0
    started: float = 0.0
    wall_s: float = 0.0
    liveness: str = ""
    """The local file the role's process touches while it runs (roles/service.py LIVENESS_ENV)."""
    group: bool = False
    """It leads a process group of its own (torchrun and its trainer ranks): signals go to the
    whole group, so no rank outlives a killed trainer."""
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.worker}"


def send_signal(rp: RoleProcess, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if rp.group:
            os.killpg(rp.pid, sig)
        else:
            os.kill(rp.pid, sig)


def role_launcher(cfg: RunConfig, role: str) -> list[str]:
    """The command that starts a role: its module, or for a trainer over several GPUs torchrun
    with one process per GPU (train/ranks.py)."""
    module = ["-m", "relax_core.entrypoints.role", role]
    gpus = cfg.services.trainer_gpus
    if role != "trainer" or gpus == 1:
        return [sys.executable, *module]
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus)]
    return [sys.executable, *torchrun, *module]


def roles_of(cfg: RunConfig) -> list[tuple[str, int]]:
    """(role, worker index) of every service this config runs; the trainer first."""
    roles = [("trainer", 0)]
    roles += [("rollout", i) for i in range(cfg.services.rollout_workers)]
    roles += [(role, 0) for role, _, _ in stage_chain(cfg)]
    return roles


def log_tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-TAIL_LINES:])
    except OSError:
        return "(no log)"


def error_line(log_path: str) -> str:
    """The last `error: ...` line a role printed to its log (what it stopped on), or ''."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, os.path.getsize(log_path) - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return ""
    found = [line for line in lines if line.startswith("error: ")]
    return found[-1].removeprefix("error: ") if found else ""


def raise_if_fatal(rp: RoleProcess, what: str) -> None:
    """A role that exited with a code no restart can cure stops the run with its error: every
    agent episode failed too long (AgentsFailed: restarting would train nothing again), or its
    storage stayed unreachable (StorageUnavailable)."""
    if rp.exit_code == AgentsFailed.exit_code:
        raise AgentsFailed(error_line(rp.log_path) or f"{rp.name} {what}")
    if rp.exit_code == StorageUnavailable.exit_code:
        raise StorageUnavailable(
            f"{rp.name} {what}: its storage stayed unreachable past "
            f"storage.outage_limit_s (its log: {rp.log_path})"
        )


def give_up_message(
    run_id: str, global_restarts: int, rp: RoleProcess, what: str, events: list[dict]
) -> str:
    """What a supervisor that gave up says: every failure and what was done, and the log of
    the role that failed last (the trainer's is on the console already)."""
    lines = [
        f"async run {run_id}: gave up after {global_restarts} whole-run restart(s): "
        f"{rp.name} {what} and has no restarts left; failures:"
    ]
    lines += [f"  {e['role']} (pid {e['pid']}): {e['failure']} -> {e['action']}" for e in events]
    if rp.role == "trainer":
        lines.append("the trainer's output is above")
    else:
        lines.append(f"last lines of {rp.log_path}:\n{log_tail(rp.log_path)}")
    return "\n".join(lines)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def unwind_on_sigterm() -> Any:
    """Make SIGTERM (a `kill`, a pod being stopped) unwind like Ctrl-C while the run lasts, so
    `run`'s cleanup stops every role: by default it ends this process at once and leaves the
    roles running with no supervisor. Returns the handler to restore; None off the main thread,
    where handlers cannot be set and the caller's stay."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, _exit)
