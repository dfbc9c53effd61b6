"""Local async mode: start every role as its own OS process and watch over them.

This is what one Flyte task runs in local execution (flytekit runs nodes one after another, so
parallel role tasks cannot run there) and what `python -m relax_core.services.run` runs for
`mode: async`. The processes are the same entry points a cluster runs as separate tasks:

    python -m relax_core.services.<role> --cfg CFG --run RUN_ID --checkpoint DIR [--worker N]

The trainer ends the run (STOP through weight sync, then `control/stop`); every other service
exits on `control/stop`. A service that exits with an error stops the run: `control/stop` is
written, the others are terminated, and the error names the role and shows its log's tail.
The OS's CPU accounting of every child (user + system seconds, from wait4) is written to
`{run_dir}/roles.json`, with each role's wall time and exit code.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields

from relax_core.config import RunConfig, config_to_dict
from relax_core.queue import open_queue
from relax_core.services.cores import ENV as CORE_SHARE_ENV
from relax_core.services.role import stage_chain
from relax_core.train import checkpoint as ckpt

log = logging.getLogger(__name__)

_GRACE_S = 60.0
_TAIL_LINES = 40


@dataclass
class RoleProcess:
    role: str
    worker: int
    log_path: str
    pid: int = 0
    exit_code: int | None = None
    cpu_s: float = 0.0
    started: float = 0.0
    wall_s: float = 0.0
    proc: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return f"{self.role}-{self.worker}"


def roles_of(cfg: RunConfig) -> list[tuple[str, int]]:
    """(role, worker index) of every service this config runs; the trainer first."""
    roles = [("trainer", 0)]
    roles += [("rollout", i) for i in range(cfg.services.rollout_workers)]
    roles += [(role, 0) for role, _, _ in stage_chain(cfg)]
    return roles


def _tail(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-_TAIL_LINES:])
    except OSError:
        return "(no log)"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class Supervisor:
    def __init__(self, cfg: RunConfig, checkpoint: str) -> None:
        self.cfg = cfg
        self.checkpoint = os.path.abspath(checkpoint)
        self.run_id = ckpt.read_state(checkpoint)["run_id"]
        self.run_dir = os.path.abspath(os.path.join(cfg.checkpoint.dir, self.run_id))
        self.queue = open_queue(cfg.queue, self.run_id)
        self.procs: list[RoleProcess] = []

    def _prepare(self) -> str:
        """Fresh control state for this launch; returns the config file the roles read."""
        os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
        # A previous launch of this run (a resume) left its stop marker and the address of a
        # trainer that no longer listens; neither may reach the new services.
        for path in ("control/stop", "control/rendezvous/weights"):
            self.queue.store.delete(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.run_dir, "final_checkpoint"))
        shutil.rmtree(os.path.join(self.run_dir, "cores"), ignore_errors=True)
        cfg_path = os.path.join(self.run_dir, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config_to_dict(self.cfg), f, sort_keys=True)
        return cfg_path

    def _start(self, role: str, worker: int, cfg_path: str, env: dict[str, str]) -> None:
        log_path = os.path.join(self.run_dir, "logs", f"{role}-{worker}.log")
        rp = RoleProcess(role, worker, log_path, started=time.perf_counter())
        cmd = [sys.executable, "-m", f"relax_core.services.{role}", "--cfg", cfg_path]
        cmd += ["--run", self.run_id, "--checkpoint", self.checkpoint, "--worker", str(worker)]
        with open(log_path, "ab") as out:
            # The trainer's progress bar and log go to this console as well as its file.
            stderr = None if role == "trainer" else out
            rp.proc = subprocess.Popen(cmd, stdout=out, stderr=stderr, env=env)
        rp.pid = rp.proc.pid
        self.procs.append(rp)

    def _reap(self, rp: RoleProcess, block: bool = False) -> bool:
        """Collect `rp`'s exit status and CPU time if it has exited."""
        if rp.exit_code is not None:
            return True
        pid, status, usage = os.wait4(rp.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        rp.exit_code = os.waitstatus_to_exitcode(status)
        rp.cpu_s = usage.ru_utime + usage.ru_stime
        rp.wall_s = time.perf_counter() - rp.started
        assert rp.proc is not None
        rp.proc.returncode = rp.exit_code  # Popen must not wait for a pid already reaped
        return True

    def _terminate(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for rp in self.procs:
            if not self._reap(rp):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rp.pid, signal.SIGTERM)
        for rp in self.procs:
            while not self._reap(rp):
                if time.monotonic() > deadline:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(rp.pid, signal.SIGKILL)
                    self._reap(rp, block=True)
                    break
                time.sleep(0.05)

    def _write_accounting(self) -> None:
        keep = [f.name for f in fields(RoleProcess) if f.name != "proc"]
        rows = [{k: getattr(rp, k) for k in keep} for rp in self.procs]
        with open(os.path.join(self.run_dir, "roles.json"), "w") as f:
            json.dump(rows, f, indent=1)

    def run(self) -> str:
        """Run every role until the trainer finishes; returns the final checkpoint."""
        cfg_path = self._prepare()
        env = dict(os.environ)
        env[CORE_SHARE_ENV] = f"{os.path.join(self.run_dir, 'cores')}:{_cores()}"
        env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        env.setdefault("PYTHONUNBUFFERED", "1")
        try:
            for role, worker in roles_of(self.cfg):
                self._start(role, worker, cfg_path, env)
            log.info("async run %s: %s", self.run_id, ", ".join(p.name for p in self.procs))
            self._watch()
        finally:
            if any(rp.exit_code is None for rp in self.procs):
                self.queue.stop()
                self._terminate(10.0)
            self._write_accounting()
        with open(os.path.join(self.run_dir, "final_checkpoint")) as f:
            return f.read().strip()

    def _watch(self) -> None:
        trainer = self.procs[0]
        trainer_done_at: float | None = None
        while True:
            for rp in self.procs:
                if not self._reap(rp) or rp.exit_code == 0 and rp is not trainer:
                    continue
                if rp.exit_code != 0:
                    self.queue.stop()
                    self._terminate(10.0)
                    where = (
                        " (its output is above)"
                        if rp is trainer
                        else f"; last lines of {rp.log_path}:\n{_tail(rp.log_path)}"
                    )
                    raise RuntimeError(
                        f"async run {self.run_id}: {rp.name} exited with code {rp.exit_code}{where}"
                    )
            if trainer.exit_code == 0 and trainer_done_at is None:
                trainer_done_at = time.monotonic()
            if all(rp.exit_code is not None for rp in self.procs):
                return
            if trainer_done_at is not None and time.monotonic() - trainer_done_at > _GRACE_S:
                late = [rp.name for rp in self.procs if rp.exit_code is None]
                log.warning(
                    "services still running %.0f s after the trainer finished: %s",
                    _GRACE_S,
                    ", ".join(late),
                )
                self._terminate(5.0)
                return
            time.sleep(0.1)


def run_async_local(cfg: RunConfig, checkpoint: str) -> str:
    """Train from `checkpoint` to `train.total_steps` with every role its own process."""
    return Supervisor(cfg, checkpoint).run()
