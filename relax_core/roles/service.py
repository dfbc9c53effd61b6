"""What every async-mode service shares: its context (config, queue, run id, checkpoint),
heartbeats, stop, the stage it serves and the stage-serving loop of the transform roles.

A service is started by `python -m relax_core.entrypoints.role <role> ...` (or a Flyte task) with a
config, the run id (the queue prefix) and the checkpoint the run continues from (its weights are
where every role starts). A service exits 0 when `control/stop` appears, and non-zero with the reason on stderr
when it fails; the supervisor (local) or Flyte (cluster) decides what happens next.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from relax_core.config import RunConfig, load_config
from relax_core.heap import freeze_heap
from relax_core.queue import TransferQueue, open_queue
from relax_core.queue.retry import set_outage_limit
from relax_core.roles.stacks import dump_stacks_on_signal
from relax_core.rollout.sidecar import tell_sidecar
from relax_core.storage import where
from relax_core.train.checkpoint import local_checkpoint
from relax_core.train.determinism import use_deterministic_kernels
from relax_core.train.factory import TRAINER_ONLY

log = logging.getLogger(__name__)

ROLES = ("rollout", "reference", "actor_fwd", "advantages", "trainer")

LIVENESS_ENV = "RELAX_LIVENESS_FILE"
"""Set by the local supervisor for each process it starts: a file on that machine which the
service touches every `services.heartbeat_s` from a thread of its own. It is what the supervisor
judges silence by: it keeps beating while the run's storage is down or slow (the storage
heartbeat waits out an outage, the process is not hung), and whichever process serves the role
beats it (torchrun's rank 0 for a multi-GPU trainer, not the torchrun process that was started)."""


def load_run_config(path_or_json: str) -> RunConfig:
    """A YAML file, a JSON file, or JSON text."""
    text = path_or_json.strip()
    if text.startswith("{"):
        return RunConfig.from_json(text)
    if path_or_json.endswith(".json"):
        with open(path_or_json) as f:
            return RunConfig.from_json(f.read())
    return load_config(path_or_json)


@dataclass
class RoleContext:
    """One running service: who it is, what it serves, and its liveness."""

    role: str
    worker: int
    cfg: RunConfig
    run_id: str
    checkpoint: str
    """A local directory holding the checkpoint the role started from (what it loads)."""
    queue: TransferQueue
    checkpoint_url: str = ""
    """Where that checkpoint is in the run's storage (what is handed on)."""
    status: dict[str, Any] = field(default_factory=dict)
    """Shown in the heartbeat (and by `relax queue`): what the service is doing now."""
    _stop_seen: bool = False
    _stop_checked: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.role}-{self.worker}"

    def stopped(self) -> bool:
        """Whether `control/stop` exists (checked at most every poll interval). Every role's
        main loop asks each round, which is what tells the stall watch it comes round."""
        mark_progress()
        now = time.monotonic()
        if not self._stop_seen and now - self._stop_checked >= self.cfg.services.poll_s:
            self._stop_checked = now
            self._stop_seen = self.queue.stopped()
        return self._stop_seen

    def sleep(self) -> None:
        time.sleep(self.cfg.services.poll_s)

    def beat(self) -> None:
        self.queue.heartbeat(self.role, str(self.worker), {**self.status, "pid": os.getpid()})

    def start_heartbeats(self) -> None:
        """Beat now and then every `services.heartbeat_s` from a daemon thread."""
        self.beat()

        def loop() -> None:
            while not self._stop_seen:
                time.sleep(self.cfg.services.heartbeat_s)
                try:
                    self.beat()
                except Exception as exc:  # a missed beat is visible as a stale heartbeat
                    log.warning("%s: heartbeat failed: %s", self.name, exc)

        threading.Thread(target=loop, name=f"heartbeat-{self.name}", daemon=True).start()


_last_progress: float | None = None
"""time.monotonic() of the main loop's last round (None before its first)."""


def mark_progress() -> None:
    """The role's main loop came round (a step, an entry, a poll): the stall watch of
    `beat_locally` counts from here."""
    global _last_progress
    _last_progress = time.monotonic()


def stalled_for(stall_s: float) -> float | None:
    """Seconds since the main loop last came round, when that is over `stall_s` (> 0) and it
    has come round before; else None."""
    last = _last_progress
    if not stall_s or last is None:
        return None
    idle = time.monotonic() - last
    return idle if idle > stall_s else None


def beat_locally(name: str, every_s: float, stall_s: float = 0.0) -> threading.Event:
    """Touch the local supervisor's liveness file (LIVENESS_ENV, when set) every `every_s` from
    a daemon thread until the returned event is set. With `stall_s` (services.stall_timeout_s)
    it stops touching while the main loop has not come round for that long (mark_progress),
    after writing every thread's stack to stderr (the role's log), so the supervisor restarts a
    role hung outside the interpreter's lock; it touches again if the loop comes round first."""
    done = threading.Event()
    path = os.environ.get(LIVENESS_ENV)

    def loop() -> None:
        failing = stalled = False
        while True:
            idle = stalled_for(stall_s)
            if idle is not None:
                if not stalled:
                    log.error(
                        "%s: the main loop has not come round for %.0f s "
                        "(services.stall_timeout_s %.0f): no more liveness, so the supervisor "
                        "restarts this role; every thread's stack follows",
                        name,
                        idle,
                        stall_s,
                    )
                    faulthandler.dump_traceback(all_threads=True)
                stalled = True
            else:
                if stalled:
                    log.warning("%s: the main loop came round again; liveness resumes", name)
                stalled = False
                try:
                    with open(path, "a"):
                        pass
                    os.utime(path)
                    failing = False
                except OSError as exc:  # said once; the supervisor sees the silence
                    if not failing:
                        log.warning("%s: liveness file %s: %s", name, path, exc)
                    failing = True
            if done.wait(every_s):
                return

    if path:
        threading.Thread(target=loop, name=f"liveness-{name}", daemon=True).start()
    return done


def set_threads(n: int) -> None:
    import torch

    if n > 0:
        torch.set_num_threads(n)


def run_role(
    role: str,
    serve: Callable[[RoleContext], None],
    cfg: RunConfig,
    run_id: str,
    checkpoint: str,
    worker: int = 0,
) -> None:
    """Serve `role` in this process until the run stops (a Flyte task calls this directly)."""
    dump_stacks_on_signal()
    # Alive from here on, also while the checkpoint download waits out a storage outage.
    alive = beat_locally(f"{role}-{worker}", cfg.services.heartbeat_s, cfg.services.stall_timeout_s)
    # In the rollout pod: its SGLang sidecar stops when this process ends, however it ends.
    sidecar_done = tell_sidecar()
    try:
        set_outage_limit(cfg.storage.outage_limit_s)
        use_deterministic_kernels(cfg.train.deterministic)
        queue = open_queue(cfg.queue, run_id)
        # Only the trainer loads optimizer state and master weights: the others never download
        # them.
        skip = () if role == "trainer" else TRAINER_ONLY
        local = local_checkpoint(checkpoint, cfg.storage.options(), cfg.storage.scratch_dir, skip)
        ctx = RoleContext(role, worker, cfg, run_id, local, queue, checkpoint_url=where(checkpoint))
        ctx.status["state"] = "starting"
        ctx.start_heartbeats()
        freeze_heap()
        serve(ctx)
        if ctx.status.get("state") != "drained":  # an elastic engine removed mid-run says so
            ctx.status["state"] = "stopped"
        ctx.beat()
    finally:
        alive.set()
        sidecar_done()


def stage_chain(cfg: RunConfig) -> list[tuple[str, str, str]]:
    """(role, input stage, output stage) of each transform role the config needs, in order.

    rollout -> [reference: ref] -> [actor_fwd: fwd] -> advantages: ready. A role the run does
    not need is left out (no reference model without a KL term or a teacher).
    """
    chain, stage = [], "rollout"
    if cfg.algorithm.kl_coef > 0 or cfg.algorithm.distill_coef > 0:
        chain.append(("reference", stage, "ref"))
        stage = "ref"
    if cfg.services.actor_fwd:
        chain.append(("actor_fwd", stage, "fwd"))
        stage = "fwd"
    chain.append(("advantages", stage, "ready"))
    return chain


def stage_of(cfg: RunConfig, role: str) -> tuple[str, str]:
    for name, source, target in stage_chain(cfg):
        if name == role:
            return source, target
    raise ValueError(f"role {role!r} does not run with this config (roles: {stage_chain(cfg)})")


def serve_stage(
    ctx: RoleContext,
    transform: Callable[[Any], Any],
    before_entry: Callable[[], None] | None = None,
    busy_threads: int = 0,
) -> None:
    """Claim input entries of this role's stage, transform them, commit at the same seq.

    The input's meta (the rollout's metrics) travels on with the output. `before_entry` runs
    between entries (e.g. apply new weights); with `busy_threads` the role marks itself busy
    on the local core share while it computes.
    """
    import contextlib

    from relax_core.queue import StageWorker
    from relax_core.queue.queue import log_path
    from relax_core.roles.cores import CoreShare

    source, target = stage_of(ctx.cfg, ctx.role)
    worker = StageWorker(ctx.queue, source, target, ctx.name, ctx.cfg.queue.lease_ttl_s)
    cores = CoreShare.from_env(ctx.name) if busy_threads else None
    ctx.status["state"] = f"serving {source} -> {target}"
    done, next_input, scanned = 0, 0, 0.0
    freeze_heap()  # the role's model is loaded by now
    while not ctx.stopped():
        if before_entry is not None:
            before_entry()
        # Idle polls cost one existence check of the next input seq; the full scan (listings,
        # expired leases of other workers) runs when it appears, or once a second.
        now = time.monotonic()
        if now - scanned < 1.0 and not ctx.queue.store.exists(log_path(source, next_input)):
            ctx.sleep()
            continue
        scanned = now
        claimed = next(iter(worker.claim()), None)
        next_input = max(worker.known_inputs(), default=-1) + 1
        if claimed is None:
            ctx.sleep()
            continue
        lease, entry = claimed
        busy = cores.busy(busy_threads) if cores else contextlib.nullcontext()
        with busy:
            table = transform(entry.table)
        worker.complete(lease, table, meta=entry.record.get("meta"))
        done += 1
        ctx.status["entries"] = done
