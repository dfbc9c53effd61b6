"""Colocate mode on vLLM: the trainer and one vLLM server take turns.

A step: generate (over HTTP, vllm_engine.py) -> reference, advantages, train -> update_weights
(v+1): the trainer is rank 0 of the server's weight-transfer group and sends every weight
through vLLM's RL API (sync/vllm.py: pause, start, buckets, finish with the version, prefix
cache reset, resume) -> the next step's generation. Nothing generates while the trainer runs, so
the pause finds the server idle.

On a CPU the server and the trainer share the machine's cores; give each its share
(services.rollout_threads and the trainer's) so neither starves the other. The generation RNG
is the server's, not saved in our checkpoints.
"""

from __future__ import annotations

import atexit
import hashlib
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.expert_names import checkpoint_names
from relax_core.rollout.server_client import ServerError
from relax_core.rollout.sglang_server import ServerProcess
from relax_core.rollout.vllm_engine import VLLMEngine


class ColocatedVLLM:
    """A `RolloutEngine` over one vLLM server that takes the trainer's weights between steps.

    With `give_back` (a server on the trainer's GPU, started with --enable-sleep-mode) the
    server sleeps while the trainer trains: level 2 (weights and KV cache released: the next
    update brings every weight) for full weights, level 1 (weights to host memory) for a LoRA
    policy, whose base no update brings. It wakes its weights for the update, and its KV cache
    for the next generation."""

    def __init__(self, engine: VLLMEngine, sender, give_back: bool = False) -> None:
        self.engine, self.sender = engine, sender
        self.give_back = give_back
        self.asleep: set[str] = set()
        """What the server released for the trainer ('weights', 'kv_cache')."""

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        self._wake(None)
        return self.engine.generate(prompts, params, media)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int):
        named = named_tensors if self.engine.lora else checkpoint_names(named_tensors)
        self._wake(["weights"])
        self.sender.push(named, version)
        if self.engine.lora:
            self.engine.refresh_version()  # the adapter requests name from now on
        self.engine.version = version

    def sleep(self) -> None:
        """Release the server's GPU memory for the trainer's step (nothing generates now)."""
        if not self.give_back or self.asleep:
            return
        level = 1 if self.engine.lora else 2
        self.engine.client.post(f"/sleep?level={level}&mode=wait", {})
        self.asleep = {"weights", "kv_cache"}

    def _wake(self, tags: list[str] | None) -> None:
        """Take back what sleep released: `tags`, or all of it."""
        wanted = self.asleep if tags is None else self.asleep & set(tags)
        if not wanted:
            return
        self.engine.client.post("/wake_up?" + "&".join(f"tags={t}" for t in sorted(wanted)), {})
        self.asleep -= wanted

    def pause(self) -> None:
        pass  # colocate: nothing generates while the trainer's weights arrive

    def resume(self) -> None:
        pass

    def health(self) -> dict[str, object]:
        return self.engine.health()

    def close(self) -> None:
        """Leave the server's weight group; a server this process started stays up for the
        next session (see _SHARED) and stops when the process exits."""
        self.sender.destroy()
        self.engine.close()


_SHARED: dict[tuple, ServerProcess] = {}
"""Servers this process started for colocate sessions, by what they were started for (the
interpreter, the launch settings, the model's config.json): a later session of the same run in
this process (the next node of a local run, an evaluation) takes the trainer's weights on the
running server instead of waiting for a new one (~30 s on a CPU). On a cluster each node is a
fresh pod, and every session starts its own."""


def _shared_key(cfg, policy_dir: str) -> tuple:
    with open(os.path.join(policy_dir, "config.json"), "rb") as f:
        model = hashlib.sha256(f.read()).hexdigest()
    v = cfg.vllm
    python = v.python or os.environ.get("RELAX_VLLM_PYTHON", "")
    return (python, model, v.max_model_len, v.kv_cache_gib, v.gpu_memory_utilization, v.extra_args)


def _stop_shared() -> None:
    for server in _SHARED.values():
        server.stop()
    _SHARED.clear()


atexit.register(_stop_shared)


def start_colocated(
    cfg, policy_dir: str, version: int, run_dir: str, specs, weights: Callable[[], Any]
) -> ColocatedVLLM:
    """The colocate engine of `cfg` (rollout.engine 'vllm'): a server on the policy (one this
    process started for an earlier session, given `weights()` as `version`; vllm.url; or a new
    one), its weight group formed with the trainer."""
    from relax_core.rollout import vllm_server
    from relax_core.sync.vllm import VLLMLoRASender, lora_dir
    from relax_core.sync.vllm_nccl import vllm_sender_class

    key = None if cfg.vllm.url else _shared_key(cfg, policy_dir)
    shared = _SHARED.get(key) if key else None
    if shared is not None and (shared.proc.poll() is not None or not _healthy(shared.client)):
        shared.stop()
        del _SHARED[key]
        shared = None
    if shared is not None:
        client = shared.client
    else:
        log_path = os.path.join(run_dir, "logs", "vllm-colocate.log")
        client, server = vllm_server.attach_or_start(
            cfg.vllm,
            0,
            policy_dir,
            version,
            log_path,
            vllm_server.launch_flags(cfg, colocated=True),
        )
        if server is not None:
            _SHARED[key] = server
    lora = cfg.train.lora.rank > 0
    engine = VLLMEngine(client, cfg.vllm.pause_mode, lora=lora)
    engine.version = version
    if lora:  # the server holds the base; each version's adapter is loaded by name
        target = lora_dir(cfg, os.path.basename(run_dir.rstrip("/")))
        sender = VLLMLoRASender(
            [("colocate", client.url)], specs, cfg.train.lora.alpha, 1, lora_dir=target
        )
    else:
        sender = vllm_sender_class(cfg, colocated=True)(
            [("colocate", client.url)],
            specs,
            bucket_bytes=cfg.services.bucket_mb << 20,
            timeout_s=cfg.services.start_timeout_s,
            pause_mode=cfg.vllm.pause_mode,
        )
    colocated = ColocatedVLLM(engine, sender, give_back=bool(cfg.services.accelerator))
    if shared is not None or lora:  # this session's weights (or adapter) go in first
        colocated.update_weights(weights(), version)
    else:
        sender.init()
    return colocated


def _healthy(client) -> bool:
    try:
        client.get("/health", timeout_s=10.0)
    except ServerError:
        return False
    return True
