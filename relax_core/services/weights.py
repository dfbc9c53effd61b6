"""Weight sync between the async trainer and the processes that hold policy copies.

The trainer is rank 0 of the broadcast group; rollout worker i is rank 1 + i; the actor_fwd
role (when on) comes last. With the object-store transport there are no ranks: every receiver
polls `weights/`.
"""

from __future__ import annotations

from typing import Any

from relax_core.config import RunConfig
from relax_core.queue import TransferQueue

GROUP = "weights"


def world_size(cfg: RunConfig) -> int:
    return 1 + cfg.services.rollout_workers + (1 if cfg.services.actor_fwd else 0)


def rank_of(cfg: RunConfig, role: str, worker: int) -> int:
    if role == "rollout":
        return 1 + worker
    if role == "actor_fwd":
        return 1 + cfg.services.rollout_workers
    raise ValueError(f"role {role!r} receives no weights")


def _backend(cfg: RunConfig) -> str:
    backend = cfg.services.sync_backend
    if backend == "auto":
        import torch

        backend = "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def make_sender(cfg: RunConfig, queue: TransferQueue, specs: list[Any]):
    s = cfg.services
    if s.weight_sync == "object_store":
        from relax_core.sync.object_store import ObjectStoreSender

        return ObjectStoreSender(queue.store, specs, bucket_bytes=s.bucket_mb << 20)
    from relax_core.sync.broadcast import BroadcastSender

    host = s.sync_host
    if s.launch == "tasks" and host in ("", "127.0.0.1", "localhost"):
        # Role pods reach the trainer at its pod address, not at loopback.
        import socket

        host = socket.gethostbyname(socket.gethostname())
    return BroadcastSender(
        queue.store,
        GROUP,
        world_size(cfg),
        specs,
        bucket_bytes=s.bucket_mb << 20,
        backend=_backend(cfg),
        host=host,
        timeout_s=s.start_timeout_s,
    )


def make_receiver(cfg: RunConfig, queue: TransferQueue, specs: list[Any], role: str, worker: int):
    s = cfg.services
    if s.weight_sync == "object_store":
        from relax_core.sync.object_store import ObjectStoreReceiver

        return ObjectStoreReceiver(queue.store, specs, poll_s=max(s.poll_s, 0.05))
    from relax_core.sync.broadcast_receiver import BroadcastReceiver

    return BroadcastReceiver(
        queue.store,
        GROUP,
        rank_of(cfg, role, worker),
        specs,
        bucket_bytes=s.bucket_mb << 20,
        timeout_s=s.start_timeout_s,
    )
