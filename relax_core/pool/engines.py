"""The rollout engine pool of an async run, as every role sees it on the run's object store.

    control/engines        {"engines": [{"name", "worker", "startup", "state", "url"?}, ...]}:
                           the pool, written only by whoever scales it (the local supervisor)
    control/drain/{name}   asks engine `name` to take no more work, commit what it admitted, exit 0
    control/sglang_sync    {"members", "version", "generation"}: the SGLang servers in the
                           trainer's SGLang weight group, written once they hold `version`
    control/sglang_servers/{name}
                           {"url"}: the server engine `name` started (or found in its pod),
                           written by its rollout process under `rollout.engine: sglang`

An engine with a `url` (registered by URL, or published by its own rollout process under
`rollout.engine: sglang`) is an SGLang server: its rollout process drives it over HTTP
(rollout/sglang_engine.py) and the trainer sends it weights through SGLang's own weight group
(sync/sglang.py), not the broadcast group, so it is not a broadcast member.

States: `starting` (process up, not yet holding the trainer's weights), `active` (taking work),
`draining` (finishing what it admitted; no longer a weight-sync member), `removed` (exited after a
drain; kept in the file for the record). Startup engines are workers 0..rollout_workers-1 of the
config; engines added by scaling out get the next worker numbers, never reused, so logs, tickets
and heartbeats of one engine are never confused with another's.

Without the file (a run on a cluster, where Flyte starts the roles) the pool is the startup
engines of the config.
"""

from __future__ import annotations

import json
from typing import Any

from relax_core.config import RunConfig
from relax_core.config.checks import SERVER_ENGINES
from relax_core.queue import TransferQueue

POOL = "control/engines"
DRAIN = "control/drain"
SGLANG_SYNC = "control/sglang_sync"
SERVERS = "control/sglang_servers"
STATES = ("starting", "active", "draining", "removed")
RECEIVERS = ("rollout", "actor_fwd")
"""The roles whose processes hold policy copies and take the trainer's weights."""


def member_name(role: str, worker: int) -> str:
    """A weight-sync member's name: `{role}-{worker}`."""
    if role not in RECEIVERS:
        raise ValueError(f"role {role!r} receives no weights (receivers: {RECEIVERS})")
    return f"{role}-{worker}"


def engine_name(worker: int) -> str:
    return member_name("rollout", worker)


def startup_pool(cfg: RunConfig) -> list[dict[str, Any]]:
    return [
        {"name": engine_name(i), "worker": i, "startup": True, "state": "active"}
        for i in range(cfg.services.rollout_workers)
    ]


def read_pool(cfg: RunConfig, queue: TransferQueue) -> list[dict[str, Any]]:
    """The pool as last written, or the config's startup engines when nobody wrote one."""
    try:
        data = json.loads(queue.store.read_bytes(POOL))
    except FileNotFoundError:
        return startup_pool(cfg)
    return list(data["engines"])


def write_pool(queue: TransferQueue, engines: list[dict[str, Any]]) -> None:
    for e in engines:
        if e["state"] not in STATES:
            raise ValueError(f"engine {e['name']}: state {e['state']!r} is not one of {STATES}")
    queue.store.write_replace(POOL, json.dumps({"engines": engines}, indent=1).encode())


def weight_members(cfg: RunConfig, queue: TransferQueue) -> list[str]:
    """Who receives the trainer's weights now: actor_fwd (when on), then every engine that is
    not draining or removed, in worker order (ranks follow this order)."""
    members = [member_name("actor_fwd", 0)] if cfg.services.actor_fwd else []
    if cfg.rollout.engine in SERVER_ENGINES:
        return members  # every engine is a server in the servers' weight group
    engines = sorted(read_pool(cfg, queue), key=lambda e: e["worker"])
    return members + [
        e["name"] for e in engines if e["state"] in ("starting", "active") and not e.get("url")
    ]


def external_engines(cfg: RunConfig, queue: TransferQueue) -> list[tuple[str, str]]:
    """(name, URL) of the SGLang (or vLLM) servers that receive the trainer's weights now, in worker
    order: every external engine that is not draining or removed."""
    engines = sorted(read_pool(cfg, queue), key=lambda e: e["worker"])
    out = []
    for e in engines:
        if e["state"] not in ("starting", "active"):
            continue
        url = e.get("url") or (cfg.rollout.engine in SERVER_ENGINES and published_server(queue, e))
        if url:
            out.append((e["name"], url))
    return out


def publish_server(queue: TransferQueue, name: str, url: str) -> None:
    queue.store.write_replace(f"{SERVERS}/{name}", json.dumps({"url": url}).encode())


def withdraw_server(queue: TransferQueue, name: str) -> None:
    queue.store.delete(f"{SERVERS}/{name}")


def published_server(queue: TransferQueue, engine: dict[str, Any]) -> str:
    """The URL engine's rollout process published for its server; empty until it has one."""
    try:
        return str(json.loads(queue.store.read_bytes(f"{SERVERS}/{engine['name']}"))["url"])
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return ""


def pool_entry(cfg: RunConfig, queue: TransferQueue, name: str) -> dict[str, Any] | None:
    return next((e for e in read_pool(cfg, queue) if e["name"] == name), None)


def write_sglang_sync(queue: TransferQueue, members: list[str], version: int, generation: int):
    record = {"members": members, "version": version, "generation": generation}
    queue.store.write_replace(SGLANG_SYNC, json.dumps(record).encode())


def sglang_synced(queue: TransferQueue, name: str) -> bool:
    """Whether external engine `name` is in the trainer's SGLang weight group (so it holds the
    trainer's weights)."""
    try:
        return name in json.loads(queue.store.read_bytes(SGLANG_SYNC))["members"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return False


def request_drain(queue: TransferQueue, name: str) -> None:
    queue.store.write_replace(f"{DRAIN}/{name}", b"{}")


def cancel_drain(queue: TransferQueue, name: str) -> None:
    queue.store.delete(f"{DRAIN}/{name}")


def drain_requested(queue: TransferQueue, name: str) -> bool:
    return queue.store.exists(f"{DRAIN}/{name}")
