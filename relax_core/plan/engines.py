"""The rollout engines' and the model-only roles' parts on one GPU, and what an engine itself
refuses (weights that do not fit its pool, a KV cache that cannot hold one sequence).

- SGLang: `--mem-fraction-static` of the card for weights (bf16, split by tensor parallel) and
  the KV pool; SGLang keeps the rest for activations and CUDA graphs.
- vLLM: `gpu_memory_utilization` of the card for everything it holds.
- torch engine: the policy in model.dtype on the first of its GPUs, and the KV cache of one
  generate call (rollout_batch_groups x n_samples sequences, at most 1024, of prompt +
  response).
- reference / actor_fwd: the policy in model.dtype, one layer's forward and the logits.
"""

from __future__ import annotations

from relax_core.config import RunConfig
from relax_core.plan.devices import GIB, Gpu
from relax_core.plan.parts import CUDA_CONTEXT, Part, engine_kv_tokens, layer_activation_bytes
from relax_core.plan.shapes import Shape

TORCH_ENGINE_MAX_BATCH = 1024
"""Sequences the torch engine decodes at once (rollout/torch_engine.py max_batch_size)."""


def dtype_bytes(cfg: RunConfig) -> int:
    return 4 if cfg.model.dtype == "float32" else 2


def engine_parts(cfg: RunConfig, shape: Shape, gpu: Gpu, seq: int) -> list[Part]:
    """One engine GPU's parts (the torch engine's first GPU), CUDA context included."""
    if cfg.rollout.engine == "sglang":
        frac = cfg.sglang.mem_fraction_static
        return [
            Part(
                f"SGLang static pool ({frac:g}: weights + KV cache)",
                int(frac * gpu.memory),
                "sglang.mem_fraction_static",
            ),
            Part("CUDA context", CUDA_CONTEXT),
        ]
    if cfg.rollout.engine == "vllm":
        util = cfg.vllm.gpu_memory_utilization
        return [
            Part(
                f"vLLM ({util:g}: weights, KV cache, activations, context)",
                int(util * gpu.memory),
                "vllm.gpu_memory_utilization",
            )
        ]
    return torch_engine_parts(cfg, shape, seq) + [Part("CUDA context", CUDA_CONTEXT)]


def torch_engine_parts(cfg: RunConfig, shape: Shape, seq: int) -> list[Part]:
    width = dtype_bytes(cfg)
    groups = cfg.services.rollout_batch_groups or cfg.rollout.groups_per_step
    seqs = min(TORCH_ENGINE_MAX_BATCH, groups * cfg.rollout.n_samples_per_prompt)
    kv = seqs * seq * shape.kv_bytes_per_token * width // 2
    return [
        Part(f"engine weights ({cfg.model.dtype})", width * shape.params, "a larger GPU"),
        Part(
            f"engine KV cache ({seqs} sequences x {seq:,} tokens)",
            kv,
            "services.rollout_batch_groups, rollout.max_new_tokens",
        ),
    ]


def forward_parts(cfg: RunConfig, shape: Shape, tokens: int, response: int) -> list[Part]:
    """A reference or actor_fwd role: weights and a no-grad forward of one micro-batch."""
    width = dtype_bytes(cfg)
    layer = layer_activation_bytes(shape, "torch", tokens)
    return [
        Part(f"weights ({cfg.model.dtype})", width * shape.params, "a larger GPU"),
        Part("forward (one layer at a time)", int(layer * tokens), "train.micro_batch_tokens"),
        Part("logits (response tokens)", 12 * shape.vocab * response, "train.micro_batch_tokens"),
        Part("CUDA context", CUDA_CONTEXT),
    ]


def engine_problems(cfg: RunConfig, shape: Shape, gpu: Gpu, seq: int) -> list[str]:
    """What the engine refuses at start on `gpu`: its weights over its memory budget, or no
    room for the KV cache of one whole sequence."""
    tp = cfg.services.rollout_gpus
    if cfg.rollout.engine == "sglang":
        budget, setting = cfg.sglang.mem_fraction_static * gpu.memory, "sglang.mem_fraction_static"
    elif cfg.rollout.engine == "vllm":
        budget = cfg.vllm.gpu_memory_utilization * gpu.memory
        setting = "vllm.gpu_memory_utilization"
    else:
        return []
    weights = 2 * shape.params / tp
    kv_tokens = engine_kv_tokens(shape, int(budget), int(weights), tp)
    name = cfg.rollout.engine
    if kv_tokens >= seq:
        return []
    return [
        f"rollout ({name}): {budget / GIB:.1f} GiB ({setting}) holds the weights "
        f"({weights / GIB:.1f} GiB over tensor parallel {tp}) and KV cache for {kv_tokens:,} "
        f"tokens, fewer than one sequence ({seq:,}); raise {setting} or services.rollout_gpus"
    ]
