"""Weight sync from the trainer to vLLM servers, through vLLM's own weight-transfer API (0.32).

The servers run the `relax_gloo` weight-transfer engine (packages/relax-vllm-weights, installed
in vLLM's environment and registered through vLLM's plugin entry point); the trainer is rank 0 of
its gloo group and drives each update over HTTP, as SGLangSender does for SGLang (sglang.py,
whose group bookkeeping this reuses):
1. form: ask each server for its ranks (`GET /get_world_size`; a server with data-parallel
   replicas is refused: run one server per replica), give each `rank_offset` = 1 + the ranks
   before it, and `POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
   world_size, rank_offset, group_name, timeout_s}}` on every server at once while this process
   joins as rank 0. A second init (a restarted trainer, a new engine set) replaces a server's
   group, so nothing of a dead trainer's group needs destroying.
2. update version v: `POST /pause?mode=&clear_cache=true` (vllm.pause_mode; the clear preempts
   requests a `keep` pause froze, so their KV is computed again), `/start_weight_update`, then per
   bucket `/update_weights {"update_info": {names, dtype_names, shapes}}` on every server while
   rank 0 broadcasts the bucket as one flat uint8 tensor, then `/finish_weight_update
   {"weight_version": "v"}` (completions name it in their weight_versions spans),
   `/reset_prefix_cache?reset_running_requests=true` (again, after the weights changed: no
   request is served from KV or prefix cache that older weights computed), and `/resume`
   however the update ended.

Names are the checkpoint names vLLM's `load_weights` takes (per-expert MoE names), as for SGLang.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import torch
from relax_vllm_weights import BACKEND, GlooInitInfo, gloo_group

from relax_core.rollout.server_client import ServerClient, ServerError
from relax_core.rollout.vllm_engine import PAUSE_MODES, VLLMEngine, VLLMError
from relax_core.rollout.vllm_lora import publish_adapter, write_adapter
from relax_core.sync.buckets import Bucket
from relax_core.sync.sglang import SGLangSender
from relax_core.sync.sglang_lora import SGLangLoRASender

log = logging.getLogger(__name__)


class VLLMSender(SGLangSender):
    """Rank 0 of a gloo group whose other ranks are vLLM servers' workers."""

    what = "vLLM"
    client_class = ServerClient
    transport = "gloo"
    """The process-group backend of this side (relax_gloo: the broadcast goes through host
    memory)."""

    def __init__(self, engines: Any, specs: list[Any], **options: Any) -> None:
        pause_mode = options.pop("pause_mode", "wait")
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"vllm.pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        options["backend"] = self.transport
        super().__init__(engines, specs, pause_mode=pause_mode, **options)

    def wanted(self) -> list[tuple[str, str]]:
        """The pool's servers that answer now. One that died (its rollout worker starts it
        again and publishes the new one) is left out of this update rather than failing it:
        the others get the version, and it rejoins once it is back."""
        alive = []
        for name, url in super().wanted():
            try:
                self._client(name, url).get("/health", timeout_s=10.0)
            except ServerError as err:
                log.warning("vLLM engine %s is left out of this update: %s", name, err)
                continue
            alive.append((name, url))
        return alive

    def _update(self, stream: Any, version: int) -> None:
        self._each(f"/pause?mode={self.pause_mode}&clear_cache=true", {})
        try:
            futures = [(n, self._executor().submit(self._start, n, u)) for n, u in self.members]
            for n, future in futures:
                self._result(n, future)
            with torch.no_grad(), contextlib.closing(stream):
                for _, bucket, tensors in stream:
                    self._send_bucket(bucket, tensors, None)
            self._each("/finish_weight_update", {"weight_version": str(version)})
            for answer in self._each("/reset_prefix_cache?reset_running_requests=true", {}):
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise VLLMError("a vLLM server refused to reset its prefix cache")
        finally:
            self._each("/resume", {})

    def _start(self, name: str, url: str) -> None:
        """Open server `name`'s weight update. One a trainer left open (it died mid-update) is
        finished first: vLLM refuses a second start, and every weight follows anyway."""
        client = self._client(name, url)
        try:
            client.post_ok("/start_weight_update", {})
        except ServerError as err:
            if "already active" not in str(err):
                raise
            log.warning("vLLM engine %s had a weight update open; finishing it first", name)
            client.post_ok("/finish_weight_update", {})
            client.post_ok("/start_weight_update", {})

    def _ranks(self, name: str, url: str) -> int:
        ranks, replicas = VLLMEngine(self._client(name, url), concurrency=1).parallel_shape()
        if replicas != 1:
            raise VLLMError(
                f"vLLM engine {name} ({url}) runs {replicas} data-parallel replicas; run one "
                "server per replica (each a rollout worker) instead"
            )
        return ranks

    def _join_request(
        self, name: str, url: str, offset: int, world: int, port: int, group: str
    ) -> Any:
        info = {
            "master_address": self.host,
            "master_port": port,
            "world_size": world,
            "rank_offset": offset,
            "group_name": group,
            "timeout_s": self.timeout_s,
        }
        return self._init_engine(name, url, info, BACKEND)

    def _init_engine(self, name: str, url: str, info: dict[str, Any], backend: str) -> Any:
        """`/init_weight_transfer_engine` on server `name`; returns once it joined the group."""
        try:
            return self._client(name, url).post("/init_weight_transfer_engine", {"init_info": info})
        except ServerError as err:
            package = (
                ", the relax-vllm-weights package in its environment" if backend == BACKEND else ""
            )
            raise VLLMError(
                f"{err}; the server must run the {backend!r} weight-transfer engine "
                f'(--weight-transfer-config \'{{"backend": "{backend}"}}\'{package}; '
                "vllm.weight_transfer says which)"
            ) from err

    def _join(self, port: int, world: int, group: str) -> Any:
        info = GlooInitInfo(self.host, port, world, 0, group, self.timeout_s)
        return gloo_group(info, 0)

    def _destroy_previous(self, wanted: list[tuple[str, str]]) -> None:
        self.previous = None  # a server's next init replaces whatever group it held

    def _leave(self) -> None:
        if self.group is None:
            return
        for name, url in self.members:
            with contextlib.suppress(ServerError):
                self._client(name, url).post("/shutdown_weight_transfer_engine", {}, 30.0)
        self.group = None

    def _send_bucket(
        self, bucket: Bucket, tensors: dict[str, torch.Tensor], version: int | None
    ) -> None:
        futures = self._post_update_info(bucket)
        self.group.broadcast(self._flat_bytes(bucket, tensors), 0).wait()
        for n, future in futures:
            self._result(n, future)

    def _post_update_info(self, bucket: Bucket) -> list[tuple[str, Any]]:
        """`/update_weights` for `bucket` on every member, in flight while rank 0 broadcasts."""
        body = {
            "update_info": {
                "names": [s.name for s in bucket.specs],
                "dtype_names": [s.dtype for s in bucket.specs],
                "shapes": [list(s.shape) for s in bucket.specs],
            }
        }
        return [
            (n, self._executor().submit(self._client(n, u).post, "/update_weights", body))
            for n, u in self.members
        ]


class VLLMLoRASender(SGLangLoRASender):
    """The trainer's adapter versions to vLLM servers started with --enable-lora: each version
    written once as PEFT's files under `lora_dir`, then loaded by path on every server
    (rollout/vllm_lora.py). No weight group and no pause: running requests keep the adapter they
    named, new ones name the newest."""

    what = "vLLM"

    def __init__(self, engines: Any, specs: list[Any], alpha: float, keep: int, **options: Any):
        self.lora_dir = options.pop("lora_dir")
        super().__init__(engines, specs, alpha, keep, **options)
        self._written: dict[int, str] = {}
        self._lock = threading.Lock()

    def _publish(self, name: str, client: Any, version: int, tensors) -> None:
        with self._lock:  # one copy of each version for every server on this machine
            if version not in self._written:
                self._written = {
                    version: write_adapter(self.lora_dir, version, tensors, self.config)
                }
        client = ServerClient(client.url, timeout_s=self.timeout_s)
        if name not in self._tp:  # the rendezvous record names each server's ranks
            self._tp[name] = VLLMEngine(client, concurrency=1).parallel_shape()[0]
        publish_adapter(client, version, self._written[version], self.keep, self.lora_dir)


def lora_dir(cfg: Any, run_id: str) -> str:
    """Where a run's adapter versions go for its vLLM servers (vllm.lora_dir/<run id>)."""
    return os.path.join(cfg.vllm.lora_dir, run_id)
