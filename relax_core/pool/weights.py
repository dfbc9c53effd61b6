"""Weight sync between the async trainer and the processes that hold policy copies.

The trainer is rank 0 of the broadcast group; its members are named `{role}-{worker}`: actor_fwd
(when on) first, then the rollout engines of the pool that are not draining, in worker order
(`engines.weight_members`, read again before every update, so the group follows the elastic
pool). With the object-store transport there are no members: every receiver polls `weights/`.
SGLang servers (registered by URL, or each rollout worker's own under `rollout.engine: sglang`)
get the same updates through SGLang's own weight group (`TrainerSync`, sync/sglang.py), or for a
LoRA policy as adapters loaded by name (sync/sglang_lora.py); a run whose engines are all SGLang
servers has no broadcast group unless actor_fwd needs one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from relax_core.config import RunConfig
from relax_core.config.checks import SERVER_ENGINES
from relax_core.pool.engines import (
    external_engines,
    member_name,
    weight_members,
    write_sglang_sync,
)
from relax_core.queue import TransferQueue
from relax_core.rollout.expert_names import checkpoint_layout, checkpoint_names
from relax_core.sync.buckets import TensorSpec, replayable

log = logging.getLogger(__name__)

GROUP = "weights"
SGLANG_GROUP = "sglang"
"""control/rendezvous/sglang: the SGLang weight group as last formed (master address and port,
each server's rank offset and TP size)."""


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
        from relax_core.net import pod_address

        host = pod_address()
    broadcast = None
    if cfg.rollout.engine not in SERVER_ENGINES or s.actor_fwd:
        broadcast = BroadcastSender(
            queue.store,
            GROUP,
            lambda: weight_members(cfg, queue),
            specs,
            bucket_bytes=s.bucket_mb << 20,
            backend=_backend(cfg),
            host=host,
            timeout_s=s.start_timeout_s,
        )

    def servers() -> list[tuple[str, str]]:  # read again at every update: the pool changes
        return external_engines(cfg, queue)

    if cfg.rollout.engine == "vllm" and cfg.train.lora.rank > 0:  # adapters by name
        from relax_core.rollout.sglang_lora import versions_kept
        from relax_core.sync.vllm import VLLMLoRASender, lora_dir

        vllm = VLLMLoRASender(
            servers,
            specs,
            cfg.train.lora.alpha,
            versions_kept(cfg),
            timeout_s=s.start_timeout_s,
            lora_dir=lora_dir(cfg, queue.run_id),
        )
        return TrainerSync(broadcast, vllm, queue)
    if cfg.rollout.engine == "vllm":  # vLLM's weight-transfer API (sync/vllm.py)
        from relax_core.sync.vllm_nccl import vllm_sender_class

        vllm = vllm_sender_class(cfg)(
            servers,
            checkpoint_specs(specs),
            bucket_bytes=s.bucket_mb << 20,
            host=host,
            timeout_s=s.start_timeout_s,
            pause_mode=cfg.vllm.pause_mode,
        )
        return TrainerSync(broadcast, vllm, queue)
    if cfg.train.lora.rank > 0:  # the adapter alone, loaded by name on every server
        from relax_core.rollout.sglang_lora import versions_kept
        from relax_core.sync.sglang_lora import SGLangLoRASender

        sglang = SGLangLoRASender(
            servers, specs, cfg.train.lora.alpha, versions_kept(cfg), s.start_timeout_s
        )
        return TrainerSync(broadcast, sglang, queue)
    sglang = sglang_sender(
        servers,
        specs,
        bucket_bytes=s.bucket_mb << 20,
        backend=_backend(cfg),
        host=host,
        timeout_s=s.start_timeout_s,
        pause_mode=cfg.sglang.pause_mode,
        previous=_previous_sglang_group(queue),
    )
    return TrainerSync(broadcast, sglang, queue)


def sglang_sender(engines: Any, specs: list[Any], **options: Any) -> Any:
    """SGLang's weight group for the trainer's layout `specs` (transformers' in-memory names,
    as `TrainerSync` is given them): SGLang loads checkpoint names, so fused MoE experts are
    planned, and sent, one expert matrix at a time."""
    from relax_core.sync.sglang import SGLangSender

    return SGLangSender(engines, checkpoint_specs(specs), **options)


def checkpoint_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """`specs` under the checkpoint names SGLang loads (rollout/expert_names.py)."""
    return [
        TensorSpec(name, shape, spec.dtype)
        for spec in specs
        for name, shape in checkpoint_layout(spec.name, spec.shape)
    ]


def _previous_sglang_group(queue: TransferQueue) -> dict | None:
    """The SGLang group an earlier trainer of this run recorded (its servers may still hold it)."""
    try:
        return json.loads(queue.store.read_bytes(f"control/rendezvous/{SGLANG_GROUP}"))
    except FileNotFoundError:
        return None


class TrainerSync:
    """The trainer's two weight groups as one sender: the broadcast group (actor_fwd and torch
    engines) and SGLang's group (external engines; formed when the first one registers).
    After an update that changed the SGLang group, `control/sglang_sync` names its members, so
    a new external engine's rollout process knows its server holds the trainer's weights."""

    def __init__(self, broadcast: Any | None, sglang: Any, queue: TransferQueue) -> None:
        self.broadcast, self.sglang, self.queue = broadcast, sglang, queue
        """`broadcast` is None when nothing but SGLang servers hold the policy
        (rollout.engine 'sglang' without actor_fwd)."""

    @property
    def generation(self) -> int:
        return (self.broadcast or self.sglang).generation

    def init(self) -> None:
        if self.broadcast is not None:
            self.broadcast.init()

    def needs_reform(self) -> bool:
        broadcast = self.broadcast is not None and self.broadcast.needs_reform()
        return broadcast or self.sglang.needs_reform()

    def push_or_reform(self, weights: Any, version: int) -> bool:
        """Push `weights` (named tensors, or a function streaming them such as a backend's
        `named_weights`: each transport then reads its own pass, and no copy of the model is
        kept) to the SGLang servers, then the broadcast members. True if a group re-formed."""
        named = replayable(weights)
        # SGLang servers first: their rollout processes learn of a new version by polling, the
        # broadcast members at once; the other order would hand every admission the new
        # version opens to the broadcast members.
        if self._push_servers(named, version):
            members = [name for name, _ in self.sglang.members]
            if members:  # who is at which rank, for `relax queue` and whoever debugs a hang
                record = json.dumps(self.sglang.rendezvous, indent=1).encode()
                self.queue.store.write_replace(f"control/rendezvous/{SGLANG_GROUP}", record)
            write_sglang_sync(self.queue, members, version, self.sglang.generation)
            if self.broadcast is None:
                return self.sglang.generation > 0
        if self.broadcast is None:
            return False
        return self.broadcast.push_or_reform(named, version)

    def _push_servers(self, named: Any, version: int) -> bool:
        """The servers' push; once more to those that answer when one of them died under it
        (a sender that leaves out servers that do not answer: vLLM's), so the trainer does
        not fail, and restart, for a server its worker restarts anyway."""
        try:
            return self.sglang.push(checkpoint_names(named()), version)
        except RuntimeError as err:
            if not self.sglang.needs_reform():
                raise
            log.warning("the update to version %d failed (%s); sending it again", version, err)
            self.sglang.push(checkpoint_names(named()), version)
            return True

    def destroy(self) -> None:
        try:
            if self.broadcast is not None:
                self.broadcast.destroy()
        finally:
            self.sglang.destroy()


def make_receiver(cfg: RunConfig, queue: TransferQueue, specs: list[Any], role: str, worker: int):
    s = cfg.services
    if s.weight_sync == "object_store":
        from relax_core.sync.object_store import ObjectStoreReceiver

        return ObjectStoreReceiver(queue.store, specs, poll_s=max(s.poll_s, 0.05))
    from relax_core.sync.broadcast_receiver import BroadcastReceiver

    return BroadcastReceiver(
        queue.store,
        GROUP,
        member_name(role, worker),
        specs,
        bucket_bytes=s.bucket_mb << 20,
        timeout_s=s.start_timeout_s,
    )
