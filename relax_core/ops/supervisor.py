"""Local async mode: start every role as its own OS process and keep the run going.

This is what one Flyte task runs in local execution (flytekit runs nodes one after another, so
parallel role tasks cannot run there) and what `python -m relax_core.entrypoints.run` runs for
`mode: async`. The processes are the same entry points a cluster runs as separate tasks:

    python -m relax_core.entrypoints.role <role> --cfg CFG --run-id RUN_ID --checkpoint DIR [--worker N]

Parts:
- start: every role with the run's newest checkpoint; logs under `{run_dir}/logs/`.
- watch: a role that exits with an error, or whose liveness file (local, touched by its process
  every `services.heartbeat_s`; roles/service.py) is older than `services.heartbeat_timeout_s`
  (before its first beat: `services.start_timeout_s`), is a failure; a silent one is killed.
- recover: a failure is restarted in place (the trainer from its newest checkpoint, rollout
  re-generating the groups it had admitted but not committed) up to `services.max_role_restarts`
  times per role within `services.restart_window_s`; beyond that the whole run restarts from
  the newest checkpoint, up to `services.max_global_restarts` times; then the run gives up with
  a report of every failure.
- scale: the rollout engine pool is elastic (elastic.py): the scaling API (scale_api.py) asks
  for engines, this loop starts them and retires drained ones; a whole-run restart starts the
  pool as it was.
- account: `{run_dir}/roles.json` holds every process (incarnations included) with its CPU seconds
  (from wait4), wall time and exit code; `{run_dir}/recovery.json` every failure and what was
  done about it, and every scaling operation.

The trainer ends the run (STOP through weight sync, then `control/stop`); every other service
exits on `control/stop`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields

from relax_core.config import RunConfig, config_to_dict
from relax_core.ops.elastic import ElasticPool
from relax_core.ops.notify import Notifier
from relax_core.ops.placement import Slot, env_for, preflight_gpus, visible_devices
from relax_core.ops.processes import (
    RoleProcess,
    give_up_message,
    raise_if_fatal,
    role_launcher,
    roles_of,
    send_signal,
    unwind_on_sigterm,
    usable_cores,
)
from relax_core.queue import StorageUnavailable, open_queue
from relax_core.queue.retry import set_outage_limit
from relax_core.roles.cores import ENV as CORE_SHARE_ENV
from relax_core.roles.service import LIVENESS_ENV
from relax_core.storage import join, local_dir_for, read_json, remove_file, where, write_json
from relax_core.train import checkpoint as ckpt
from relax_core.train import preemption
from relax_core.train.checkpoint import FINAL_CHECKPOINT

log = logging.getLogger(__name__)

_GRACE_S = 60.0


class GaveUp(RuntimeError):
    """The run failed more often than its restart budget allows."""


class Supervisor:
    def __init__(self, cfg: RunConfig, checkpoint: str) -> None:
        self.cfg = cfg
        set_outage_limit(cfg.storage.outage_limit_s)
        self.options = cfg.storage.options()
        self.checkpoint = where(checkpoint)
        self.run_id = ckpt.read_state(checkpoint, self.options)["run_id"]
        self.run_dir = where(join(cfg.checkpoint.dir, self.run_id))
        """The run's checkpoints and reports (a local directory or a URL)."""
        self.local_dir = local_dir_for(self.run_dir, cfg.storage.scratch_dir)
        """What stays on this machine: logs, the roles' config file, core shares, the API."""
        self.queue = open_queue(cfg.queue, self.run_id)
        self.procs: list[RoleProcess] = []
        """Every process started, incarnations included (the accounting)."""
        self.live: dict[str, RoleProcess] = {}
        """The current process of each role instance."""
        self.restarts: dict[str, int] = {}
        self.global_restarts = 0
        self._recent: dict[str, list[float]] = {}
        """Monotonic times of each role's in-place restarts within the restart window."""
        self.events: list[dict] = []
        self._cfg_path = ""
        self._env: dict[str, str] = {}
        self.notifier = Notifier(cfg.services.notify, self.run_id)
        self.pool: ElasticPool | None = None
        self.api = None
        """The scaling API's server (scale_api.ScaleServer) while the run goes on."""
        self.placement: list[Slot] = []
        """Each model-holding process's GPUs ([] on a CPU run)."""
        self._newest_seen = self.checkpoint
        """The newest checkpoint of the run this supervisor has listed (for messages)."""

    def _prepare(self) -> str:
        """Fresh control state for this launch; returns the config file the roles read."""
        os.makedirs(os.path.join(self.local_dir, "logs"), exist_ok=True)
        # A previous launch of this run (a resume) left its stop marker and the address of a
        # trainer that no longer listens; neither may reach the new services.
        for path in ("control/stop", "control/rendezvous/weights"):
            self.queue.store.delete(path)
        remove_file(join(self.run_dir, FINAL_CHECKPOINT), self.options)
        for part in ("cores", "liveness"):
            shutil.rmtree(os.path.join(self.local_dir, part), ignore_errors=True)
        os.makedirs(os.path.join(self.local_dir, "liveness"))
        cfg_path = os.path.join(self.local_dir, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config_to_dict(self.cfg), f, sort_keys=True)
        return cfg_path

    def _place(self) -> None:
        """Decide every process's GPUs (placement.py) and check their memory (relax_core/plan):
        refused before anything starts when they do not fit; printed, and kept in the run dir."""
        self.placement, printed = preflight_gpus(self.cfg, visible_devices())
        print(printed, file=sys.stderr, flush=True)
        rows = [dataclasses.asdict(slot) for slot in self.placement]
        write_json(join(self.run_dir, "placement.json"), rows, self.options)

    def _newest_checkpoint(self) -> str:
        fallback = self.cfg.checkpoint.fallback_to_previous
        found = ckpt.resume_checkpoint(self.run_dir, self.options, fallback)
        self._newest_seen = found or self.checkpoint
        return self._newest_seen

    def _preempt(self) -> preemption.Preempted:
        """On SIGTERM (the pod is going away) the trainer checkpoints its step first, within
        services.preemption_grace_s, served by the other roles; the caller then stops them."""
        grace = self.cfg.services.preemption_grace_s
        trainer = self.live.get("trainer-0")
        if trainer is not None and not self._reap(trainer):
            log.warning("SIGTERM: the trainer checkpoints at the end of its step (%.0f s)", grace)
            if self._terminate(grace, [trainer]):
                log.error("no checkpoint within services.preemption_grace_s = %.0f s", grace)
        newest = self._newest_checkpoint()
        return preemption.Preempted(newest, ckpt.read_state(newest, self.options)["policy_version"])

    def _start(self, role: str, worker: int) -> RoleProcess:
        name = f"{role}-{worker}"
        incarnation = sum(1 for p in self.procs if p.name == name)
        log_path = os.path.join(self.local_dir, "logs", f"{name}.log")
        rp = RoleProcess(role, worker, log_path, incarnation, started=time.perf_counter())
        rp.liveness = os.path.join(self.local_dir, "liveness", f"{name}.{incarnation}")
        env = {**self._env, **env_for(self.placement, name), LIVENESS_ENV: rp.liveness}
        cmd = [*role_launcher(self.cfg, role), "--cfg", self._cfg_path]
        cmd += ["--run-id", self.run_id, "--checkpoint", self._newest_checkpoint()]
        cmd += ["--worker", str(worker)]
        rp.group = role == "trainer" and self.cfg.services.trainer_gpus > 1
        with open(log_path, "ab") as out:
            # The trainer's progress bar and log go to this console as well as its file.
            stderr = None if role == "trainer" else out
            rp.proc = subprocess.Popen(
                cmd, stdout=out, stderr=stderr, env=env, start_new_session=rp.group
            )
        rp.pid = rp.proc.pid
        self.procs.append(rp)
        self.live[name] = rp
        return rp

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

    def _kill(self, rp: RoleProcess) -> None:
        send_signal(rp, signal.SIGKILL)
        self._reap(rp, block=True)

    def _terminate(self, grace_s: float, procs: list[RoleProcess] | None = None) -> bool:
        """SIGTERM the live processes (or `procs`), SIGKILL what is left after `grace_s`;
        whether any had to be killed."""
        deadline = time.monotonic() + grace_s
        live = list(self.live.values()) if procs is None else procs
        for rp in live:
            if not self._reap(rp):
                send_signal(rp, signal.SIGTERM)
        killed = False
        for rp in live:
            while not self._reap(rp):
                if time.monotonic() > deadline:
                    self._kill(rp)
                    killed = True
                    break
                time.sleep(0.05)
        return killed

    def _write_accounting(self) -> None:
        keep = [f.name for f in fields(RoleProcess) if f.name != "proc"]
        rows = [{k: getattr(rp, k) for k in keep} for rp in self.procs]
        write_json(join(self.run_dir, "roles.json"), rows, self.options)
        write_json(join(self.run_dir, "recovery.json"), self.report(), self.options)

    def report(self) -> dict:
        return {
            "role_restarts": dict(sorted(self.restarts.items())),
            "global_restarts": self.global_restarts,
            "events": self.events,
            "scale_operations": self.pool.history() if self.pool else [],
        }

    # ---- the elastic pool's host (elastic.EngineHost) ----------------------------------
    def start_engine(self, worker: int) -> None:
        self._start("rollout", worker)

    def engine_process(self, name: str) -> tuple[int, int | None] | None:
        rp = self.live.get(name)
        return None if rp is None else (rp.pid, rp.exit_code)

    def _serve_scale_api(self) -> None:
        from relax_core.ops.scale_api import ScaleServer, api_token, write_api_file

        s = self.cfg.services
        token = api_token()
        self.api = ScaleServer(self.pool, s.scale_api_host, s.scale_api_port, token)
        path = write_api_file(self.local_dir, self.api.url, token)
        log.info("elastic rollout API at %s (URL and token in %s)", self.api.url, path)

    def run(self) -> str:
        """Run every role until the trainer finishes; returns the final checkpoint."""
        self._cfg_path = self._prepare()
        self._place()
        env = dict(os.environ)
        env[CORE_SHARE_ENV] = f"{os.path.join(self.local_dir, 'cores')}:{usable_cores()}"
        env.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._env = env
        self.pool = ElasticPool(self.cfg, self.queue, self)
        previous_sigterm = unwind_on_sigterm()
        storage_down = False
        try:
            if self.cfg.services.scale_api:
                self._serve_scale_api()
            self._start_all()
            self._watch()
            restarts = sum(e["action"].startswith("restarted in place") for e in self.events)
            self.notifier.send(
                "run finished",
                f"trained to step {self.cfg.train.total_steps}; {restarts} in-place and "
                f"{self.global_restarts} whole-run restart(s) on the way",
                "success",
            )
        except SystemExit as exit_:
            if exit_.code != preemption.EXIT_CODE:
                raise
            raise self._preempt() from None
        except StorageUnavailable as err:
            storage_down = True  # nothing more can be written there: stop what runs
            raise StorageUnavailable(
                f"async run {self.run_id} stopped: {err}. Its checkpoints stay on that "
                f"storage (the newest this supervisor saw: {self._newest_seen}); once it is "
                "reachable, run again with checkpoint.resume: true"
            ) from err
        finally:
            if self.api is not None:
                self.api.close()
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.local_dir, "scale_api.json"))
            if any(rp.exit_code is None for rp in self.live.values()):
                if not storage_down:
                    self.queue.stop()
                self._terminate(10.0)
            if not storage_down:
                self._write_accounting()
            if previous_sigterm is not None:
                signal.signal(signal.SIGTERM, previous_sigterm)
        return read_json(join(self.run_dir, FINAL_CHECKPOINT), self.options)["checkpoint"]

    def _start_all(self) -> None:
        self.live = {}
        for role, worker in roles_of(self.cfg):
            self._start(role, worker)
        assert self.pool is not None
        for worker in self.pool.extra_workers():
            self._start("rollout", worker)
        log.info("async run %s: %s", self.run_id, ", ".join(self.live))

    def _silent(self, rp: RoleProcess) -> float | None:
        """Seconds since `rp`'s process last touched its liveness file, if that is longer than
        the timeout."""
        timeout = self.cfg.services.heartbeat_timeout_s
        try:
            beat = os.stat(rp.liveness).st_mtime
        except FileNotFoundError:
            # Not beating yet (still importing): given as long as joining takes.
            age = time.perf_counter() - rp.started
            grace = max(timeout, self.cfg.services.start_timeout_s)
            return age if age > grace else None
        silent = time.time() - beat
        return silent if silent > timeout else None

    def _failures(self) -> list[tuple[RoleProcess, str]]:
        """Live role processes that failed since the last look, with what happened."""
        failed = []
        for rp in list(self.live.values()):
            if self._reap(rp):
                if rp.exit_code != 0:
                    failed.append((rp, f"exited with code {rp.exit_code}"))
                continue
            silent = self._silent(rp)
            if silent is not None:
                self._kill(rp)
                failed.append((rp, f"silent for {silent:.0f} s (no heartbeat); killed"))
        return failed

    def _recover(self, rp: RoleProcess, what: str) -> None:
        """Restart `rp` in place, or the whole run, or give up (GaveUp)."""
        s = self.cfg.services
        event = {"time": time.time(), "role": rp.name, "pid": rp.pid, "failure": what}
        self.events.append(event)
        now = time.monotonic()
        recent = [t for t in self._recent.get(rp.name, []) if now - t < s.restart_window_s]
        used = len(recent)
        if used < s.max_role_restarts:
            self._recent[rp.name] = [*recent, now]
            self.restarts[rp.name] = self.restarts.get(rp.name, 0) + 1
            event["action"] = f"restarted in place ({used + 1}/{s.max_role_restarts})"
            log.warning("%s %s: %s", rp.name, what, event["action"])
            self.notifier.send(
                f"{rp.name} restarted", f"{rp.name} {what}; {event['action']}", "warning"
            )
            self._start(rp.role, rp.worker)
            return
        if self.global_restarts < s.max_global_restarts:
            self.global_restarts += 1
            event["action"] = (
                f"whole run restarted from {self._newest_checkpoint()} "
                f"({self.global_restarts}/{s.max_global_restarts})"
            )
            log.warning("%s %s: %s", rp.name, what, event["action"])
            self.notifier.send("run restarted", f"{rp.name} {what}; {event['action']}", "warning")
            self.queue.stop()
            self._terminate(10.0)
            self._cfg_path = self._prepare()
            self._recent = {}
            self._start_all()
            return
        event["action"] = "gave up"
        self.queue.stop()
        self._terminate(10.0)
        message = give_up_message(self.run_id, self.global_restarts, rp, what, self.events)
        self.notifier.send("run gave up", message, "failure")
        raise GaveUp(message)

    def _watch(self) -> None:
        trainer_done_at: float | None = None
        while True:
            for rp, what in self._failures():
                raise_if_fatal(rp, what)
                if trainer_done_at is None:
                    self._recover(rp, what)
                else:  # the run is over; a service failing on its way out changes nothing
                    log.warning("%s %s after the trainer finished", rp.name, what)
            trainer = self.live["trainer-0"]
            if trainer.exit_code is None and not self.queue.stopped():
                assert self.pool is not None
                beats = self.queue.heartbeats()  # what each engine does (not its liveness)
                self.pool.tick({f"{b['role']}-{b['worker_id']}": b for b in beats})
            if trainer.exit_code == 0 and trainer_done_at is None:
                trainer_done_at = time.monotonic()
            if all(rp.exit_code is not None for rp in self.live.values()):
                return
            if trainer_done_at is not None and time.monotonic() - trainer_done_at > _GRACE_S:
                late = [rp.name for rp in self.live.values() if rp.exit_code is None]
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
