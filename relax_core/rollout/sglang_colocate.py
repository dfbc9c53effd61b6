"""Colocate mode on SGLang: the trainer and the server take turns on the same GPUs.

A step of the colocate controller with this engine:
  generate (server awake) -> sleep(): /release_memory_occupation (weights and KV cache freed,
  the trainer gets the GPU memory) -> reference, advantages, train -> update_weights(v+1): the
  trainer's tensors as safetensors under `sglang.handoff_dir`, /resume_memory_occupation
  {"tags": ["weights"]}, /update_weights_from_disk {model_path, weight_version} -> resume():
  /resume_memory_occupation {"tags": ["kv_cache", "cuda_graph"]} -> the next step's generation.

The generation RNG is the server's (its sampling seed), not saved in our checkpoints.
Weights go through node-local files, not a process group: a trainer rank and an SGLang rank on
the same GPU cannot be two members of one NCCL group. The server must be started with
`--enable-memory-saver` for the release to free anything.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.sglang_engine import SGLangEngine
from relax_core.rollout.sglang_server import SGLangServer

ALL_TAGS = ["weights", "kv_cache", "cuda_graph"]
"""SGLang's memory tags (torch_memory_saver regions)."""


class ColocatedSGLang:
    """A `RolloutEngine` over one SGLang server that sleeps while the trainer runs."""

    def __init__(
        self,
        engine: SGLangEngine,
        handoff_dir: str,
        policy_dir: str,
        release_memory: bool = True,
        server: SGLangServer | None = None,
    ) -> None:
        self.engine = engine
        self.handoff_dir = handoff_dir
        self.policy_dir = policy_dir
        self.release_memory = release_memory
        self.server = server
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

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int):
        """Hand the trainer's weights over as files and load them as `version`."""
        target = os.path.join(self.handoff_dir, f"v{version:06d}")
        partial = f"{target}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        try:
            tensors = {n: t.detach().to("cpu").contiguous() for n, t in named_tensors}
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
            if "weights" in self.released:
                self.engine.resume_memory(["weights"])
                self.released.discard("weights")
            self.engine.client.post_ok(
                "/update_weights_from_disk",
                {"model_path": target, "weight_version": str(version), "flush_cache": True},
            )
        finally:
            shutil.rmtree(target, ignore_errors=True)  # loaded (or refused): never read again
        self.engine.version = version

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
    from relax_core.rollout.sglang_engine import SGLangEngine
    from relax_core.rollout.sglang_server import attach_or_start

    g = cfg.sglang
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
    )
    engine = SGLangEngine(client, g.pause_mode, routed_experts=replay)
    engine.version = version
    handoff = os.path.join(g.handoff_dir, os.path.basename(run_dir.rstrip("/")))
    return ColocatedSGLang(engine, handoff, policy_dir, g.release_memory, server)
