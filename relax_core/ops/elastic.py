"""Elastic rollout: add and remove rollout engines while a run trains.

The HTTP API in front of it is `scale_api.py`.

What an operation does (the local launcher's engines are torch-engine rollout processes):
- scale out: new engines get worker numbers past every one used in this run and start as
  processes. An engine takes work only once it holds the trainer's current weights (it joins
  the next weight-sync generation as soon as it waits for one). The operation succeeds when
  every new engine takes work.
- scale in: the engines leave weight sync, admit nothing more, commit every group they admitted,
  and exit; only then are they `removed`, so no admitted group is lost. The engines the run
  started with are protected: the pool never shrinks below them.
- cancel: a scale-out stops the engines not yet taking work (drained the same way); a scale-in
  keeps the engines still draining.
- external engines: `{"urls": [...]}` registers running SGLang servers (answering /health). Each
  gets a worker number and a rollout process that drives it over HTTP; the trainer sends it
  weights through SGLang's weight group, and it takes work once it is in that group. Scale-in
  and drain treat it like a local engine (the server itself keeps running: it is not ours).

`ElasticPool` is the state machine: API threads validate and record requests under its lock,
and the launcher's watch loop acts on them (`tick`), so processes are only started from the
launcher's own thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from typing import Any

from relax_core.config import RunConfig
from relax_core.ops.scale_requests import (
    ApiError,
    EngineHost,
    Operation,
    count_of,
    fields_of,
    probe_server,
    urls_of,
)
from relax_core.pool.engines import (
    DRAIN,
    POOL,
    cancel_drain,
    engine_name,
    request_drain,
    startup_pool,
    write_pool,
)
from relax_core.queue import TransferQueue

log = logging.getLogger(__name__)

_LIVE = ("starting", "active")


class ElasticPool:
    """The rollout engines of one local async run and the scaling operations on them."""

    def __init__(self, cfg: RunConfig, queue: TransferQueue, host: EngineHost) -> None:
        self.cfg, self.queue, self.host = cfg, queue, host
        self.lock = threading.RLock()
        self.max_engines = cfg.services.max_rollout_workers
        self.engines: dict[str, dict[str, Any]] = {e["name"]: e for e in startup_pool(cfg)}
        # Worker numbers are never reused within a run, across launches (resumes) too: a new
        # engine must not inherit another's logs, tickets or drain marker.
        used = [cfg.services.rollout_workers - 1]
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
            used += [e["worker"] for e in json.loads(queue.store.read_bytes(POOL))["engines"]]
        self.next_worker = max(used) + 1
        for name in queue.store.list_dir(DRAIN):  # a previous launch's requests are void
            queue.store.delete(f"{DRAIN}/{name}")
        self.ops: dict[str, Operation] = {}
        self.current: Operation | None = None
        self.beats: dict[str, dict[str, Any]] = {}
        self._to_start: list[int] = []
        write_pool(queue, self._pool_rows())

    # ---------------------------------------------------------------- requests (API threads)
    def describe(self) -> dict[str, Any]:
        with self.lock:
            engines = []
            for e in sorted(self.engines.values(), key=lambda e: e["worker"]):
                proc = self.host.engine_process(e["name"])
                info = self.beats.get(e["name"], {}).get("info", {})
                engines.append(
                    {
                        **e,
                        "pid": proc[0] if proc else None,
                        "policy_version": info.get("policy_version"),
                        "doing": info.get("state"),
                    }
                )
            return {
                "engines": engines,
                "live": sum(e["state"] in _LIVE for e in self.engines.values()),
                "max_engines": self.max_engines,
                "operation": self.current.to_json() if self.current else None,
            }

    def operation(self, kind: str, op_id: str) -> dict[str, Any]:
        with self.lock:
            return self._op(kind, op_id).to_json()

    def scale_out(self, body: Any) -> tuple[int, dict[str, Any]]:
        body = fields_of(body, ("target", "urls"))
        if ("target" in body) == ("urls" in body):
            raise ApiError(
                400,
                'give exactly one of "target" (local engines in all) or "urls" (SGLang servers)',
            )
        if "urls" in body:
            return self._register(body)
        target = count_of(body["target"], "target", 1, self.max_engines)
        with self.lock:
            if (same := self._busy("scale_out", body)) is not None:
                return 200, same
            live = self._live()
            if target <= len(live):
                return 200, self._nothing(f"the pool has {len(live)} engine(s); none to add")
            names = [self._add() for _ in range(target - len(live))]
            write_pool(self.queue, self._pool_rows())
            return 202, self._begin("scale_out", body, names, target).to_json()

    def _register(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """External engines: SGLang (or vLLM, for rollout.engine 'vllm') servers already running,
        driven by a rollout process each and synced through the trainer's weight group. A URL already live in the pool
        is not added again; an unreachable one refuses the whole request."""
        urls = urls_of(body["urls"])
        if self.cfg.services.weight_sync != "broadcast":
            raise ApiError(
                400,
                "external SGLang engines receive weights over a process group: they need "
                f"services.weight_sync 'broadcast' (this run uses {self.cfg.services.weight_sync!r})",
            )
        with self.lock:
            if (same := self._busy("scale_out", body)) is not None:
                return 200, same
            live = self._live()
            known = {e.get("url") for e in live}
            new = [u for u in urls if u not in known]
            if not new:
                return 200, self._nothing("every URL is a live engine of the pool already")
            if len(live) + len(new) > self.max_engines:
                raise ApiError(
                    400,
                    f"{len(new)} more engine(s) would make {len(live) + len(new)}, over "
                    f"services.max_rollout_workers {self.max_engines}",
                )
        # Outside the lock: a probe may take seconds, and /engines must stay answerable.
        for url in new:
            probe_server(url, self.cfg.rollout.engine)
        with self.lock:
            if (same := self._busy("scale_out", body)) is not None:
                return 200, same
            names = [self._add(url) for url in new]
            write_pool(self.queue, self._pool_rows())
            target = len(self._live())
            return 202, self._begin("scale_out", body, names, target).to_json()

    def _add(self, url: str | None = None) -> str:
        worker, self.next_worker = self.next_worker, self.next_worker + 1
        name = engine_name(worker)
        entry = {"name": name, "worker": worker, "startup": False, "state": "starting"}
        if url:
            entry["url"] = url
        self.engines[name] = entry
        self._to_start.append(worker)
        return name

    def scale_in(self, body: Any) -> tuple[int, dict[str, Any]]:
        body = fields_of(body, ("target", "engines"))
        if ("target" in body) == ("engines" in body):
            raise ApiError(400, 'give exactly one of "target" (engines to keep) or "engines"')
        with self.lock:
            if (same := self._busy("scale_in", body)) is not None:
                return 200, same
            live = self._live()
            startup = [e["name"] for e in live if e["startup"]]
            if "target" in body:
                target = count_of(body["target"], "target", 1, self.max_engines)
                if target < len(startup):
                    raise ApiError(
                        400,
                        f"target {target} would remove startup engines; the engines the run "
                        f"started with ({', '.join(startup)}) are protected",
                    )
                extra = [e["name"] for e in live if not e["startup"]]
                victims = extra[::-1][: max(0, len(live) - target)]
            else:
                victims = self._named(body["engines"], live)
                target = len(live) - len(victims)
            if not victims:
                return 200, self._nothing(f"the pool has {len(live)} engine(s); none to remove")
            self._drain(victims)
            return 202, self._begin("scale_in", body, victims, target).to_json()

    def cancel(self, kind: str, op_id: str) -> dict[str, Any]:
        with self.lock:
            op = self._op(kind, op_id)
            if op.status != "running":
                raise ApiError(409, f"operation {op_id} is {op.status}; nothing to cancel")
            if kind == "scale_out":
                stopped = [n for n in op.engines if self.engines[n]["state"] == "starting"]
                self._drain(stopped)
                kept = [n for n in op.engines if n not in stopped]
                op.status = "cancelling"
                op.message = (
                    f"stopping {stopped or 'none'}; kept (already taking work) {kept or 'none'}"
                )
            else:
                kept = [n for n in op.engines if self.engines[n]["state"] == "draining"]
                for name in kept:
                    self.engines[name]["state"] = "active"
                    cancel_drain(self.queue, name)
                write_pool(self.queue, self._pool_rows())
                gone = [n for n in op.engines if n not in kept]
                self._finish(op, "cancelled", f"kept {kept or 'none'}; removed {gone or 'none'}")
            return op.to_json()

    # ---------------------------------------------------------------- acting (launcher thread)
    def extra_workers(self) -> list[int]:
        """Engines beyond the startup ones that must run (a whole-run restart starts them)."""
        with self.lock:
            return sorted(
                e["worker"]
                for e in self.engines.values()
                if not e["startup"]
                and e["state"] != "removed"
                and e["worker"] not in self._to_start
            )

    def tick(self, beats: dict[str, dict[str, Any]]) -> None:
        """Start what was asked for and move engines and the operation along."""
        with self.lock:
            self.beats = beats
            while self._to_start:
                self.host.start_engine(self._to_start.pop(0))
            changed = False
            for e in self.engines.values():
                proc = self.host.engine_process(e["name"])
                if e["state"] == "starting" and proc and proc[1] is None:
                    info = beats.get(e["name"], {}).get("info", {})
                    if info.get("pid") == proc[0] and info.get("taking_work"):
                        e["state"], changed = "active", True
                        log.info(
                            "%s takes work (weights v%s)", e["name"], info.get("policy_version")
                        )
                elif e["state"] == "draining" and (proc is None or proc[1] == 0):
                    e["state"], changed = "removed", True
                    log.info("%s drained and removed", e["name"])
                elif e["state"] in _LIVE and proc and proc[1] == 0:
                    # It drained just before a cancel un-drained it: it is wanted, run it again.
                    self.host.start_engine(e["worker"])
            if changed:
                write_pool(self.queue, self._pool_rows())
            self._advance()

    def history(self) -> list[dict[str, Any]]:
        with self.lock:
            return [op.to_json() for op in self.ops.values()]

    # ---------------------------------------------------------------- internals
    def _drain(self, names: list[str]) -> None:
        """Out of weight sync first (the pool file), then asked to drain: a draining engine
        needs no weights. One not started yet is simply not started."""
        for name in names:
            self.engines[name]["state"] = "draining"
            if self.engines[name]["worker"] in self._to_start:
                self._to_start.remove(self.engines[name]["worker"])
        write_pool(self.queue, self._pool_rows())
        for name in names:
            request_drain(self.queue, name)

    def _advance(self) -> None:
        op = self.current
        if op is None:
            return
        states = [self.engines[n]["state"] for n in op.engines]
        if op.status == "running" and op.kind == "scale_out" and all(s == "active" for s in states):
            self._finish(op, "succeeded", f"{', '.join(op.engines)} taking work")
        elif (
            op.status == "running" and op.kind == "scale_in" and all(s == "removed" for s in states)
        ):
            self._finish(op, "succeeded", f"{', '.join(op.engines)} drained and removed")
        elif op.status == "cancelling" and not any(s in ("starting", "draining") for s in states):
            self._finish(op, "cancelled", op.message)

    def _finish(self, op: Operation, status: str, message: str) -> None:
        op.status, op.message, op.finished = status, message, time.time()
        if self.current is op:
            self.current = None
        log.info("%s %s: %s (%s)", op.kind, op.id, status, message)

    def _begin(self, kind: str, body: Any, engines: list[str], target: int) -> Operation:
        op = Operation(f"op-{uuid.uuid4().hex[:12]}", kind, body, engines, target)
        self.ops[op.id] = op
        self.current = op
        log.info("%s %s: %s", kind, op.id, ", ".join(engines))
        return op

    def _busy(self, kind: str, body: Any) -> dict[str, Any] | None:
        """The running operation if it is this same request (a retry); 409 if another runs."""
        op = self.current
        if op is None:
            return None
        if op.kind == kind and op.request == body and op.status == "running":
            return op.to_json()
        raise ApiError(
            409,
            f"{op.kind} {op.id} is {op.status}; one operation at a time (poll {op.to_json()['url']}"
            " or cancel it)",
            operation=op.to_json(),
        )

    def _nothing(self, message: str) -> dict[str, Any]:
        return {"id": None, "status": "succeeded", "message": message, "engines": []}

    def _live(self) -> list[dict[str, Any]]:
        return sorted(
            (e for e in self.engines.values() if e["state"] in _LIVE), key=lambda e: e["worker"]
        )

    def _named(self, names: Any, live: list[dict[str, Any]]) -> list[str]:
        if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
            raise ApiError(
                400, f'"engines" must be a non-empty list of engine names, got {names!r}'
            )
        if len(set(names)) != len(names):
            raise ApiError(400, f'"engines" names an engine twice: {names}')
        in_pool = {e["name"] for e in live}
        unknown = [n for n in names if n not in in_pool]
        if unknown:
            raise ApiError(400, f"{unknown} not in the pool (live engines: {sorted(in_pool)})")
        protected = [n for n in names if self.engines[n]["startup"]]
        if protected:
            raise ApiError(400, f"{protected} started with the run and are protected")
        return names

    def _op(self, kind: str, op_id: str) -> Operation:
        op = self.ops.get(op_id)
        if op is None or op.kind != kind:
            raise ApiError(404, f"no {kind} operation {op_id!r}")
        return op

    def _pool_rows(self) -> list[dict[str, Any]]:
        return sorted(self.engines.values(), key=lambda e: e["worker"])
