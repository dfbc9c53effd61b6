"""Building the Megatron-core pieces: process groups, GPTModel from an HF config, DDP, optimizer.

megatron.core is imported inside each function, so this module imports on machines without it.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import torch

from relax_core.train.megatron.config import (
    TORCH_DTYPES,
    MegatronParallel,
    gpt_model_kwargs,
    transformer_config_kwargs,
)
from relax_core.train.megatron.names import Dims


def init_parallel(parallel: MegatronParallel, seed: int = 0) -> None:
    """torch.distributed (one process per GPU; torchrun's env, else a single local process) and
    Megatron's model-parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=1 if parallel.ep > 1 else parallel.tp,
        )
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def resolve_spec(spec: str) -> str:
    """'te' when TransformerEngine is importable, else 'local'; an explicit choice is kept."""
    if spec not in ("auto", "te", "local"):
        raise ValueError(f"spec must be 'auto', 'te' or 'local', got {spec!r}")
    if spec != "auto":
        return spec
    return "te" if importlib.util.find_spec("transformer_engine") is not None else "local"


def build_gpt(
    hf_config: Any,
    parallel: MegatronParallel,
    dtype: str,
    spec: str,
    max_sequence_length: int | None = None,
    cpu_init: bool = False,
    routing_replay: bool = False,
    moe_aux_loss_coeff: float = 0.0,
):
    """(GPTModel, TransformerConfig) for an HF Qwen3 / Qwen3-MoE config; `spec` 'te' or 'local'.
    `routing_replay`: each MoE router gets a RouterReplay (replay.py finds them on the model);
    `moe_aux_loss_coeff`: the router load-balancing loss, 0 for RL (config.py says why)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe.router_replay import RouterReplay

    kwargs = transformer_config_kwargs(
        hf_config,
        parallel,
        dtype,
        routing_replay=routing_replay,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
    )
    config = TransformerConfig(**kwargs, use_cpu_initialization=cpu_init)
    if Dims.from_hf(hf_config).num_experts:  # per-layer specs: dense and MoE layers may mix
        layer_spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=spec == "te", normalization="RMSNorm"
        )
    elif spec == "te":
        layer_spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        layer_spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    # Every RouterReplay appends itself to a process-global list; drop those of earlier models
    # so they are not kept alive (replay.py reads each model's own, never the global list).
    RouterReplay.clear_global_router_replay_instances()
    model = GPTModel(
        config,
        layer_spec,
        pre_process=True,
        post_process=True,
        **gpt_model_kwargs(hf_config, max_sequence_length),
    )
    return model, config


def wrap_ddp(model: torch.nn.Module, config: Any, parallel: MegatronParallel):
    """Megatron's DistributedDataParallel: grads in contiguous fp32 buffers, reduced over DP."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=parallel.distributed_optimizer,
    )
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def build_optimizer(
    ddp_model: torch.nn.Module,
    lr: float,
    weight_decay: float,
    grad_clip: float,
    dtype: str,
    parallel: MegatronParallel,
):
    """Adam (decoupled weight decay, betas as the torch backend) via get_megatron_optimizer."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    config = OptimizerConfig(
        optimizer="adam",
        lr=lr,
        weight_decay=weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.99,
        clip_grad=grad_clip,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        params_dtype=TORCH_DTYPES[dtype],
        use_distributed_optimizer=parallel.distributed_optimizer,
    )
    return get_megatron_optimizer(config, [ddp_model])
