"""Model dimensions read from an HF Qwen3 / Qwen3-MoE config, and Megatron GPTModel tensor names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EMBEDDING = "embedding.word_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
OUTPUT = "output_layer.weight"

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")


@dataclass(frozen=True)
class Dims:
    """The sizes conversion and sharding need, from an HF config."""

    model_type: str
    num_layers: int
    hidden: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    num_experts: int = 0
    moe_ffn: int = 0
    moe_layers: tuple[bool, ...] = ()

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_query_groups

    @classmethod
    def from_hf(cls, hf_config: Any) -> Dims:
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"hf_config.model_type is {model_type!r}; the Megatron backend supports "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        c = hf_config
        layers = c.num_hidden_layers
        heads, groups = c.num_attention_heads, c.num_key_value_heads
        if heads % groups:
            raise ValueError(f"num_attention_heads ({heads}) must divide by num_key_value_heads")
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        experts = (getattr(c, "num_experts", 0) or 0) if model_type == "qwen3_moe" else 0
        moe = tuple(_is_sparse(c, i) for i in range(layers)) if experts else (False,) * layers
        return cls(
            model_type=model_type,
            num_layers=layers,
            hidden=c.hidden_size,
            num_heads=heads,
            num_query_groups=groups,
            head_dim=head_dim,
            ffn=c.intermediate_size,
            vocab=c.vocab_size,
            tied=bool(getattr(c, "tie_word_embeddings", False)),
            num_experts=experts,
            moe_ffn=getattr(c, "moe_intermediate_size", 0) if experts else 0,
            moe_layers=moe,
        )


def _is_sparse(c: Any, layer: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule for which layers get the sparse MoE block."""
    step = getattr(c, "decoder_sparse_step", 1) or 1
    return layer not in (getattr(c, "mlp_only_layers", None) or []) and (layer + 1) % step == 0


def is_moe_layer(dims: Dims, layer: int) -> bool:
    return bool(dims.moe_layers) and dims.moe_layers[layer]


def hf_layer_shapes(dims: Dims, layer: int) -> dict[str, tuple[int, ...]]:
    """HF suffix -> shape of every tensor of decoder layer `layer` (per-expert layout)."""
    d, h = dims.head_dim, dims.hidden
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (dims.num_heads * d, h),
        "self_attn.k_proj.weight": (dims.num_query_groups * d, h),
        "self_attn.v_proj.weight": (dims.num_query_groups * d, h),
        "self_attn.o_proj.weight": (h, dims.num_heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
    }
    if is_moe_layer(dims, layer):
        shapes["mlp.gate.weight"] = (dims.num_experts, h)
        for e in range(dims.num_experts):
            shapes[f"mlp.experts.{e}.gate_proj.weight"] = (dims.moe_ffn, h)
            shapes[f"mlp.experts.{e}.up_proj.weight"] = (dims.moe_ffn, h)
            shapes[f"mlp.experts.{e}.down_proj.weight"] = (h, dims.moe_ffn)
    else:
        shapes["mlp.gate_proj.weight"] = (dims.ffn, h)
        shapes["mlp.up_proj.weight"] = (dims.ffn, h)
        shapes["mlp.down_proj.weight"] = (h, dims.ffn)
    return shapes


def mcore_layer_names(dims: Dims, layer: int, spec: str, grouped_experts: bool) -> dict[str, str]:
    """Logical key ('qkv', 'fc1', 'expert_fc1.{e}', ...) -> full Megatron name for one layer."""
    if spec not in ("te", "local"):
        raise ValueError(f"spec must be 'te' or 'local', got {spec!r}")
    p = f"decoder.layers.{layer}."
    moe = is_moe_layer(dims, layer)
    names = {
        "qkv": p + "self_attention.linear_qkv.weight",
        "q_norm": p + "self_attention.q_layernorm.weight",
        "k_norm": p + "self_attention.k_layernorm.weight",
        "proj": p + "self_attention.linear_proj.weight",
        "input_norm": p
        + (
            "self_attention.linear_qkv.layer_norm_weight"
            if spec == "te"
            else "input_layernorm.weight"
        ),
        "mlp_norm": p
        + (
            "mlp.linear_fc1.layer_norm_weight"
            if spec == "te" and not moe
            else "pre_mlp_layernorm.weight"
        ),
    }
    if not moe:
        names["fc1"] = p + "mlp.linear_fc1.weight"
        names["fc2"] = p + "mlp.linear_fc2.weight"
        return names
    names["router"] = p + "mlp.router.weight"
    for e in range(dims.num_experts):
        for fc in ("fc1", "fc2"):
            names[f"expert_{fc}.{e}"] = p + (
                f"mlp.experts.linear_{fc}.weight{e}"
                if grouped_experts
                else f"mlp.experts.local_experts.{e}.linear_{fc}.weight"
            )
    return names
