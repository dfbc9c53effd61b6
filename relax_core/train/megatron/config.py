"""Parallel layout of the Megatron backend, and HF Qwen3 config -> megatron-core constructor
arguments. Pure: importable without megatron (the GPU image has it, CPU CI does not)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from relax_core.train.megatron.names import Dims


@dataclass(frozen=True)
class MegatronParallel:
    """How one model replica is split over GPUs; data parallel is whatever world size is left."""

    tp: int = 1
    """Tensor parallel size: attention heads and MLP columns split over this many GPUs."""
    pp: int = 1
    """Pipeline parallel size: decoder layers split into this many stages."""
    cp: int = 1
    """Context parallel size: the sequence split over this many GPUs."""
    ep: int = 1
    """Expert parallel size (MoE): experts split over this many GPUs."""
    sequence_parallel: bool = False
    """Shard norms/dropout activations along the sequence over the TP group (needs tp > 1)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    recompute: bool = False
    """Full activation recompute: each layer keeps its input and recomputes the rest in
    backward (train.activation_checkpointing as the memory plan resolved it)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MegatronParallel.{name} must be an integer >= 1, got {value!r}")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("MegatronParallel.sequence_parallel needs tp > 1 (got tp=1)")

    def padded_length(self, length: int) -> int:
        """The sequence length the model runs on: with sequence parallel, `length` right-padded
        to a multiple of tp (the sequence is split evenly over the TP ranks)."""
        if self.sequence_parallel and length % self.tp:
            return length + self.tp - length % self.tp
        return length

    def check_model(self, hf_config: Any) -> None:
        """Raise ValueError naming the field when this layout cannot split the model."""
        dims = Dims.from_hf(hf_config)
        if dims.num_heads % self.tp:
            raise ValueError(
                f"MegatronParallel.tp={self.tp} must divide num_attention_heads ({dims.num_heads})"
            )
        if dims.num_query_groups % self.tp and self.tp % dims.num_query_groups:
            raise ValueError(
                f"MegatronParallel.tp={self.tp} must be a multiple or a divisor of "
                f"num_key_value_heads ({dims.num_query_groups})"
            )
        if dims.vocab % self.tp:
            raise ValueError(f"MegatronParallel.tp={self.tp} must divide vocab_size ({dims.vocab})")
        if dims.num_layers % self.pp:
            raise ValueError(
                f"MegatronParallel.pp={self.pp} must divide num_hidden_layers ({dims.num_layers})"
            )
        if self.ep > 1 and not dims.num_experts:
            raise ValueError(f"MegatronParallel.ep={self.ep} needs an MoE model (got dense)")
        if dims.num_experts and dims.num_experts % self.ep:
            raise ValueError(
                f"MegatronParallel.ep={self.ep} must divide num_experts ({dims.num_experts})"
            )


def fit_to_layer_spec(
    parallel: MegatronParallel, spec: str, hf_config: Any
) -> tuple[MegatronParallel, str]:
    """The layout layer spec `spec` ('te' or 'local') can train, and a line for the log when it
    differs from `parallel` ('' when it does not).

    The local spec (megatron-core 0.19 gpt_layer_specs.py:get_gpt_layer_local_spec, and
    get_gpt_decoder_block_spec without TransformerEngine) builds its RMSNorms as
    transformer/torch_norm.py:WrappedTorchNorm, whose __new__ asserts
    `not config.sequence_parallel`. Sequence parallel only shards activations (same results,
    less memory), so on 'local' it is turned off. An MoE model cannot train with tp > 1 without
    it (transformer/moe/moe_layer.py:MoELayer.forward raises in training when the attention TP
    group is larger than 1 and sequence_parallel is off): that is refused, naming the fields.
    """
    if spec not in ("te", "local"):
        raise ValueError(f"spec must be 'te' or 'local', got {spec!r}")
    if spec == "te":
        return parallel, ""
    if Dims.from_hf(hf_config).num_experts and parallel.tp > 1:
        raise ValueError(
            f"train.parallel.tensor: {parallel.tp} with an MoE policy needs sequence parallel, "
            "which needs TransformerEngine (not installed: megatron-core's local layer spec "
            "refuses sequence parallel); use train.parallel.tensor 1 and split the experts "
            "with train.parallel.expert"
        )
    if not parallel.sequence_parallel:
        return parallel, ""
    return replace(parallel, sequence_parallel=False), (
        "train.parallel.sequence_parallel is on but TransformerEngine is not installed: "
        "megatron-core's local layer spec (torch norms) does not support sequence parallel, so "
        f"it is off for this run (tensor parallel {parallel.tp} still splits the model; "
        "activations are not sharded, so they take more memory)"
    )


TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def transformer_config_kwargs(
    hf_config: Any,
    parallel: MegatronParallel,
    dtype: str = "bfloat16",
    routing_replay: bool = False,
    moe_aux_loss_coeff: float = 0.0,
) -> dict[str, Any]:
    """Keyword arguments of megatron.core.transformer.TransformerConfig for an HF Qwen3 / Qwen3-MoE
    config. Rotary base and vocabulary are GPTModel arguments: see `gpt_model_kwargs`.
    `routing_replay` gives every MoE router a RouterReplay (rollout routing replay, replay.py).

    `moe_aux_loss_coeff` is 0 unless the caller asks: the router's load-balancing loss (and the
    z-loss, always off) would add a term to the RL policy gradient that the rollout never saw.
    The HF config's `router_aux_loss_coef` (0.001 for Qwen3-30B-A3B) is pretraining's value and
    is not taken.

    `calculate_per_token_loss` is on because each data-parallel rank's loss is its share of the
    whole step's loss (the loss functions normalise by the step's tokens): megatron-core 0.19's
    distributed_data_parallel.py:DistributedDataParallel.__init__ then sets
    gradient_scaling_factor = expert_gradient_scaling_factor = 1.0, so gradients are summed over
    data-parallel ranks, not averaged; finalize_model_grads scales only when given num_tokens,
    which the backend never passes."""
    parallel.check_model(hf_config)
    if dtype not in TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(TORCH_DTYPES)}, got {dtype!r}")
    dims = Dims.from_hf(hf_config)
    if routing_replay and not dims.num_experts:
        raise ValueError(
            f"routing_replay needs an MoE model; {dims.model_type} with no experts is dense "
            "(turn train.routing_replay off)"
        )
    kwargs: dict[str, Any] = {
        "num_layers": dims.num_layers,
        "hidden_size": dims.hidden,
        "ffn_hidden_size": dims.ffn,
        "num_attention_heads": dims.num_heads,
        "num_query_groups": dims.num_query_groups,
        "kv_channels": dims.head_dim,
        "normalization": "RMSNorm",
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "qk_layernorm": True,
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": bool(getattr(hf_config, "attention_bias", False)),
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "bf16": dtype == "bfloat16",
        "fp16": dtype == "float16",
        "params_dtype": TORCH_DTYPES[dtype],
        "pipeline_dtype": TORCH_DTYPES[dtype],
        "tensor_model_parallel_size": parallel.tp,
        "pipeline_model_parallel_size": parallel.pp,
        "context_parallel_size": parallel.cp,
        "expert_model_parallel_size": parallel.ep,
        "sequence_parallel": parallel.sequence_parallel,
        "calculate_per_token_loss": True,
    }
    if parallel.recompute:  # one layer per checkpointed chunk, as HF's gradient checkpointing
        kwargs.update(
            recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if dims.num_experts:
        if moe_aux_loss_coeff < 0:
            raise ValueError(f"moe_aux_loss_coeff must be >= 0, got {moe_aux_loss_coeff}")
        kwargs.update(_moe_kwargs(hf_config, dims, parallel, moe_aux_loss_coeff))
        kwargs["moe_enable_routing_replay"] = routing_replay
    return kwargs


def _moe_kwargs(
    hf_config: Any, dims: Dims, parallel: MegatronParallel, aux: float
) -> dict[str, Any]:
    # HF routes with softmax over all experts then top-k, renormalized when norm_topk_prob:
    # Megatron's top-k-then-softmax equals the renormalized form, pre_softmax the plain one.
    return {
        "num_moe_experts": dims.num_experts,
        "moe_router_topk": hf_config.num_experts_per_tok,
        "moe_ffn_hidden_size": dims.moe_ffn,
        "moe_layer_freq": [int(m) for m in dims.moe_layers],
        "moe_router_pre_softmax": not bool(getattr(hf_config, "norm_topk_prob", False)),
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
        "moe_aux_loss_coeff": aux,
        "moe_z_loss_coeff": None,  # megatron-core's default; None skips the z-loss (router.py)
        "moe_token_dispatcher_type": "alltoall" if parallel.ep > 1 else "allgather",
        "moe_grouped_gemm": False,  # SequentialMLP: per-expert names convert.py writes
        "expert_tensor_parallel_size": 1 if parallel.ep > 1 else parallel.tp,
    }


def gpt_model_kwargs(hf_config: Any, max_sequence_length: int | None = None) -> dict[str, Any]:
    """Keyword arguments of megatron.core.models.gpt.GPTModel besides config and layer spec."""
    dims = Dims.from_hf(hf_config)
    rope = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type {rope_type!r} is not supported (only default)")
    base = rope.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return {
        "vocab_size": dims.vocab,
        "max_sequence_length": max_sequence_length or hf_config.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_base": int(base),
        "share_embeddings_and_output_weights": dims.tied,
    }
