"""Colocate mode on SGLang: the trainer and the server take turns on the same GPUs.

A step of the colocate controller with this engine:
  generate (server awake) -> sleep(): /release_memory_occupation (weights and KV cache freed,
  the trainer gets the GPU memory) -> reference, advantages, train -> update_weights(v+1):
  /resume_memory_occupation {"tags": ["weights"]}, then the handover (below) -> resume():
  /resume_memory_occupation {"tags": ["kv_cache", "cuda_graph"]} -> the next step's generation.

The handover, by where the trainer's tensors are:
- on CUDA, to a server with one data-parallel replica: CUDA IPC. `/begin_weight_update`, then per
  bucket (at most `bucket_bytes`) `/update_weights_from_tensor {serialized_named_tensors,
  flush_cache, weight_version}` with one payload per TP rank (each rank opens its own, SGLang:
  TpModelWorker.deserialize_own_rank): torch's ForkingPickler bytes of [(name, tensor)], each
  tensor an IPC handle to the trainer's memory with its device named by UUID (SGLang's
  patch_torch does the same, so the handle survives a different CUDA_VISIBLE_DEVICES), base64
  for JSON; the last carries the version and the cache flush (the server sleeps, so its
  scheduler is idle and the flush goes through); then `/end_weight_update`. Nothing is copied
  but by the server, from the trainer's memory into its own. SGLang unpickles the payload (with
  an allow-list), so this path only runs between a trainer and a server in the same pod (the
  only place an IPC handle means anything);
- otherwise (CPU tensors; or `--dp-size` > 1, which SGLang 0.5.23 refuses for tensor updates):
  safetensors under `sglang.handoff_dir` (node-local memory) and `/update_weights_from_disk
  {model_path, weight_version, flush_cache}`.

A LoRA policy (`lora_alpha` set): the server keeps its base, and each version's adapter is
loaded by name, `policy-v{N}`, the previous one unloaded (rollout/sglang_lora.py); generation
names the newest. The adapter is small: it goes as CPU bytes, from any device.

The generation RNG is the server's (its sampling seed), not saved in our checkpoints.
Weights never go through a process group: a trainer rank and an SGLang rank on the same GPU
cannot be two members of one NCCL group. The server must be started with
`--enable-memory-saver` for the release to free anything.
"""

from __future__ import annotations

import base64
import contextlib
import io
import itertools
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from multiprocessing.reduction import ForkingPickler

import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions

from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.expert_names import checkpoint_names
from relax_core.rollout.sglang_engine import SGLangEngine
from relax_core.rollout.sglang_lora import (
    lora_flags,
    peft_config,
    peft_tensors,
    publish_adapter,
    require_one_replica,
    versions_kept,
)
from relax_core.rollout.sglang_server import SGLangServer

log = logging.getLogger(__name__)

ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]
"""SGLang's memory tags (torch_memory_saver regions)."""
NamedTensors = Iterable[tuple[str, torch.Tensor]]


class ColocatedSGLang:
    """A `RolloutEngine` over one SGLang server that sleeps while the trainer runs."""

    def __init__(
        self,
        engine: SGLangEngine,
        handoff_dir: str,
        policy_dir: str,
        release_memory: bool = True,
        server: SGLangServer | None = None,
        bucket_bytes: int = 512 << 20,
        lora_alpha: float | None = None,
    ) -> None:
        self.engine = engine
        self.handoff_dir = handoff_dir
        self.policy_dir = policy_dir
        self.release_memory = release_memory
        self.server = server
        self.bucket_bytes = bucket_bytes
        """At most this many bytes of tensors per /update_weights_from_tensor call."""
        self.lora_alpha = lora_alpha
        """A LoRA policy's alpha (its updates are adapters); None: full weights."""
        self._shape: tuple[int, int] | None = None
        self.released: set[str] = set()
        """Memory tags the server has given back (all of them while the trainer runs)."""

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        self.resume()
        return self.engine.generate(prompts, params, media)

    def sleep(self) -> None:
        """Free the server's GPU memory for the trainer (nothing runs on it now)."""
        if self.release_memory and not self.released:
            self.engine.release_memory(ALL_TAGS)
            self.released = set(ALL_TAGS)

    def update_weights(self, named_tensors: NamedTensors, version: int) -> None:
        """Hand the trainer's weights over (CUDA IPC or files, see the module doc) and load
        them as `version`, under the checkpoint names SGLang loads (MoE experts per expert)."""
        named = checkpoint_names(named_tensors)
        first = next(named, None)
        if first is None:
            raise ValueError("update_weights got no tensors")
        named = itertools.chain([first], named)
        if "weights" in self.released:
            self.engine.resume_memory(["weights"])
            self.released.discard("weights")
        tp_size, dp_size = self._server_shape()
        if self.lora_alpha is not None:
            self._load_adapter(named, version, tp_size, dp_size)
        elif first[1].is_cuda and dp_size == 1:
            self._update_by_ipc(named, version, tp_size)
        else:
            self._update_from_disk(named, version)
        self.engine.version = version

    def _server_shape(self) -> tuple[int, int]:
        """(tp_size, dp_size) of the server, asked once."""
        if self._shape is None:
            self._shape = self.engine.parallel_shape()
            if self._shape[1] > 1:
                log.info(
                    "the SGLang server runs %d data-parallel replicas, which SGLang refuses "
                    "tensor updates for: weights go through %s",
                    self._shape[1],
                    self.handoff_dir,
                )
        return self._shape

    def _load_adapter(self, named: Iterator, version: int, tp_size: int, dp_size: int) -> None:
        require_one_replica(self.engine.client.url, dp_size)
        tensors = peft_tensors(named)
        config = peft_config({n: tuple(t.shape) for n, t in tensors.items()}, self.lora_alpha)
        publish_adapter(self.engine.client, version, tensors, config, tp_size, keep=1)
        self.engine.use_adapter(version)

    def _update_by_ipc(self, named: Iterator, version: int, tp_size: int) -> None:
        client = self.engine.client
        client.post_ok("/begin_weight_update", {})
        try:
            batches = _batches(named, self.bucket_bytes)
            batch = next(batches)
            for following in itertools.chain(batches, [None]):
                last = following is None
                body = {
                    "serialized_named_tensors": ipc_payloads(batch, tp_size),
                    "flush_cache": last,
                }
                if last:
                    body["weight_version"] = str(version)
                client.post_ok("/update_weights_from_tensor", body)
                batch = following
        except BaseException:
            with contextlib.suppress(Exception):
                client.post_ok("/end_weight_update", {})
            raise
        client.post_ok("/end_weight_update", {})

    def _update_from_disk(self, named: Iterator, version: int) -> None:
        target = os.path.join(self.handoff_dir, f"v{version:06d}")
        partial = f"{target}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            tensors = {n: t.detach().to("cpu").contiguous() for n, t in named}
            save_file(tensors, os.path.join(partial, "model.safetensors"))
            for name in ("config.json", "generation_config.json"):
                src = os.path.join(self.policy_dir, name)
                if os.path.isfile(src):
                    shutil.copy2(src, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)  # a full disk leaves no half version
            raise
        shutil.rmtree(target, ignore_errors=True)
        os.replace(partial, target)
        try:
            self.engine.client.post_ok(
                "/update_weights_from_disk",
                {"model_path": target, "weight_version": str(version), "flush_cache": True},
            )
        finally:
            shutil.rmtree(target, ignore_errors=True)  # loaded (or refused): never read again

    def pause(self) -> None:
        pass  # colocate: nothing generates while the trainer's weights arrive

    def resume(self) -> None:
        if self.released:
            self.engine.resume_memory(sorted(self.released))
            self.released.clear()

    def health(self) -> dict[str, object]:
        return {**self.engine.health(), "released": sorted(self.released)}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        with contextlib.suppress(OSError):
            os.rmdir(self.handoff_dir)


def start_colocated(cfg, policy_dir: str, version: int, run_dir: str) -> ColocatedSGLang:
    """The colocate engine of `cfg` (rollout.engine 'sglang'): its server started on the
    policy (or sglang.url), sleeping between generations when sglang.release_memory."""
    from relax_core.rollout.sglang_server import attach_or_start

    g, lora = cfg.sglang, cfg.train.lora
    replay = bool(getattr(cfg.train, "routing_replay", False))
    client, server = attach_or_start(
        g,
        0,
        policy_dir,
        version,
        cfg.services.rollout_gpus,
        os.path.join(run_dir, "logs", "sglang-colocate.log"),
        memory_saver=g.release_memory,
        routed_experts=replay,
        lora=lora_flags(lora, versions_kept(cfg)),
    )
    engine = SGLangEngine(client, g.pause_mode, routed_experts=replay, lora=lora.rank > 0)
    engine.version = version
    handoff = os.path.join(g.handoff_dir, os.path.basename(run_dir.rstrip("/")))
    bucket_bytes = cfg.services.bucket_mb << 20
    alpha = lora.alpha if lora.rank > 0 else None
    return ColocatedSGLang(
        engine, handoff, policy_dir, g.release_memory, server, bucket_bytes, alpha
    )


def _batches(named: Iterator, bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(name, tensor) pairs in runs of at most `bucket_bytes` (a larger tensor goes alone), read
    lazily, so a trainer whose weights are converted on the way (float32 master weights sent
    as bf16) holds one run of converted tensors at a time."""
    batch: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        tensor = tensor.detach()
        if batch and size + tensor.nbytes > bucket_bytes:
            yield batch
            batch, size = [], 0
        batch.append((name, tensor))
        size += tensor.nbytes
    if batch:
        yield batch


def ipc_payloads(named: list[tuple[str, torch.Tensor]], tp_size: int) -> list[str]:
    """`serialized_named_tensors` of SGLang's /update_weights_from_tensor: one base64 payload
    of [(name, tensor)] per TP rank, CUDA tensors as IPC handles. Each rank gets its own
    serialization: torch counts an IPC handle's consumers per serialization."""
    payloads = []
    for _ in range(tp_size):
        buffer = io.BytesIO()
        pickler = ForkingPickler(buffer)
        pickler.dispatch_table[torch.Tensor] = _reduce_naming_device_by_uuid
        pickler.dump(named)
        payloads.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return payloads


def _reduce_naming_device_by_uuid(tensor: torch.Tensor):
    """torch's reduction of a shared tensor, with a CUDA tensor's device index (argument 6 of
    rebuild_cuda_tensor) replaced by the device's UUID, which SGLang maps back to its own index
    (srt/utils/patch_torch.py, _device_from_maybe_uuid)."""
    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor:
        uuid = str(torch.cuda.get_device_properties(args[6]).uuid)
        args = (*args[:6], uuid, *args[7:])
    return rebuild, args
