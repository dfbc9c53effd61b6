"""What a run with `rollout.engine: vllm` can do in this build, checked before launch.

The vLLM path (rollout/vllm_engine.py, sync/vllm.py) serves a text policy's full weights in
colocate and async runs, started per rollout worker or attached by URL. What it does not do yet
is refused here by name, with what to use instead, rather than failing at first contact.
"""

from __future__ import annotations

from typing import Any

from relax_core.config.services import VLLM_PAUSE_MODES as PAUSE_MODES
from relax_core.config.services import VLLM_TRANSFERS as TRANSFERS

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head widths vLLM 0.32's CPU attention takes (CPUAttentionBackend.get_supported_head_sizes)."""


def check_vllm(e: list[str], cfg: Any, modality: str | None) -> None:
    v, r = cfg.vllm, cfg.rollout
    if v.pause_mode not in PAUSE_MODES:
        e.append(f"vllm.pause_mode: {v.pause_mode!r} is not one of {', '.join(PAUSE_MODES)}")
    _check_transfer(e, cfg)
    if v.max_model_len < 2:
        e.append(f"vllm.max_model_len: must be >= 2, got {v.max_model_len}")
    elif r.max_new_tokens >= v.max_model_len:
        e.append(
            f"rollout.max_new_tokens: {r.max_new_tokens} leaves no room for a prompt in "
            f"vllm.max_model_len {v.max_model_len} (the server refuses a request whose prompt "
            "plus max_new_tokens exceeds it); raise vllm.max_model_len"
        )
    if not isinstance(v.kv_cache_gib, int) or v.kv_cache_gib < 1:
        e.append(f"vllm.kv_cache_gib: a whole number of GiB >= 1, got {v.kv_cache_gib!r}")
    if not 0 < v.gpu_memory_utilization <= 1:
        e.append(f"vllm.gpu_memory_utilization: must be in (0, 1], got {v.gpu_memory_utilization}")
    if v.start_timeout_s <= 0:
        e.append(f"vllm.start_timeout_s: must be > 0, got {v.start_timeout_s}")
    if v.url and not v.url.startswith(("http://", "https://")):
        e.append(f"vllm.url: must start with http:// or https://, got {v.url!r}")
    m = cfg.model
    if m.kind == "tiny-qwen3" and m.num_heads > 0 and not cfg.services.accelerator:
        head = m.hidden_size // m.num_heads
        if head not in CPU_HEAD_SIZES:
            e.append(
                f"model.num_heads: heads of width {head} (hidden_size {m.hidden_size} / "
                f"{m.num_heads}); vLLM's CPU attention takes widths {CPU_HEAD_SIZES} "
                "(configs/vllm-cpu.yaml: 6 heads of 32 at hidden size 192)"
            )
    if modality:
        e.append(
            f"rollout.engine: 'vllm' is sent text token ids in this build; a {modality} "
            "policy's media is not; use 'torch'"
        )
    if cfg.train.lora.rank > 0 and not v.lora_dir:
        e.append("vllm.lora_dir: required for a LoRA policy (adapter versions go through it)")
    if getattr(cfg.train, "routing_replay", False):
        e.append(
            "train.routing_replay: rollout.engine 'vllm' cannot replay routing here: vLLM 0.32 "
            "returns routed experts only from its V2 model runner (--enable-return-routed-"
            "experts refuses to start without VLLM_USE_V2_MODEL_RUNNER=1, which needs Triton, "
            "so no CPU build has it), and this build's rollout does not read them; use "
            "rollout.engine 'sglang' (--enable-return-routed-experts) or 'torch'"
        )
    if cfg.services.launch == "tasks":
        e.append(
            "rollout.engine: 'vllm' runs with services.launch 'processes' in this build (a "
            "rollout pod with a vLLM sidecar is not wired yet); on a cluster use 'sglang'"
        )
    if cfg.services.actor_fwd:
        e.append(
            "services.actor_fwd: with rollout.engine 'vllm' the actor-forward role would need "
            "the broadcast group beside vLLM's transfer; turn it off (the trainer recomputes "
            "old log-probs) or use rollout.engine 'torch'"
        )
    if cfg.mode == "async" and cfg.services.weight_sync != "broadcast":
        e.append(
            f"services.weight_sync: {cfg.services.weight_sync!r} with rollout.engine 'vllm'; "
            "vLLM servers receive weights through their weight-transfer engine: use 'broadcast'"
        )


def _check_transfer(e: list[str], cfg: Any) -> None:
    chosen = cfg.vllm.weight_transfer
    if chosen == "ipc":
        e.append(
            "vllm.weight_transfer: 'ipc' is not offered: vLLM 0.32's CUDA IPC engine takes its "
            "handles over HTTP only pickled, and unpickles them only with VLLM_ALLOW_INSECURE_"
            "SERIALIZATION=1 (code execution for whoever reaches the port); a colocate server "
            "takes weights through host memory instead ('auto')"
        )
    elif chosen not in TRANSFERS:
        e.append(f"vllm.weight_transfer: {chosen!r} is not one of {', '.join(TRANSFERS)}")
    elif chosen == "nccl" and not cfg.services.accelerator:
        e.append(
            "vllm.weight_transfer: 'nccl' needs GPUs (services.accelerator is empty); on CPUs "
            "use 'relax_gloo' or 'auto'"
        )
    elif chosen == "nccl" and cfg.mode == "colocate":
        e.append(
            "vllm.weight_transfer: 'nccl' in a colocate run puts the trainer and its server on "
            "one GPU, and NCCL refuses two ranks on one device; use 'relax_gloo' or 'auto'"
        )
