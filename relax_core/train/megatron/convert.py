"""HF <-> Megatron-core weights for the Qwen3 family (dense and MoE), and tensor-parallel sharding.

Pure torch; megatron is never imported here, so the conversion is tested on any machine.

Megatron GPTModel names (megatron-core 0.19, `decoder.layers.{i}.` prefix per layer):
- `self_attention.linear_qkv.weight`: Q, K, V interleaved per query group g as
  [q heads of g (heads_per_group * head_dim rows); k_g (head_dim rows); v_g (head_dim rows)].
- input norm: `self_attention.linear_qkv.layer_norm_weight` (TE spec, fused into the QKV linear)
  or `input_layernorm.weight` (local spec).
- pre-MLP norm: `mlp.linear_fc1.layer_norm_weight` (TE spec, dense layer) or
  `pre_mlp_layernorm.weight` (local spec, and every MoE layer).
- `mlp.linear_fc1.weight` = [gate; up]; MoE experts as SequentialMLP
  (`mlp.experts.local_experts.{e}.linear_fc1.weight`) or TEGroupedMLP
  (`mlp.experts.linear_fc1.weight{e}`); `mlp.router.weight` is HF's `mlp.gate.weight`.

HF side: `hf_to_megatron` reads both expert layouts, the per-expert names of HF checkpoints and
SGLang's loader (`mlp.experts.{e}.gate_proj.weight`) and transformers>=5's in-memory 3-D tensors
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]). With tied embeddings
`lm_head.weight` is an alias of the embedding: it is skipped on the way in and not emitted on the
way out (HF checkpoints and SGLang's loader leave it out too).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from relax_core.train.megatron.names import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    Dims,
    hf_layer_shapes,
    is_moe_layer,
    mcore_layer_names,
)
from relax_core.train.megatron.shard import gather_from_tp, shard_for_tp

__all__ = [
    "gather_from_tp",
    "hf_to_megatron",
    "megatron_to_hf",
    "megatron_to_hf_named",
    "merge_qkv",
    "shard_for_tp",
    "split_qkv",
]

_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MC_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_MC_EXPERT = re.compile(
    r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))"
)
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")

# Megatron layer suffix -> HF layer suffix, for the tensors that map one to one.
_ONE_TO_ONE = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
}


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: Dims) -> torch.Tensor:
    """HF q [nq*d, H], k/v [ng*d, H] -> Megatron linear_qkv [(nq + 2*ng)*d, H], grouped per kv."""
    hidden = q.shape[-1]
    q = q.reshape(dims.num_query_groups, dims.heads_per_group * dims.head_dim, hidden)
    k = k.reshape(dims.num_query_groups, dims.head_dim, hidden)
    v = v.reshape(dims.num_query_groups, dims.head_dim, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, dims: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `merge_qkv`: (q, k, v) in HF layout."""
    hidden = qkv.shape[-1]
    q_rows = dims.heads_per_group * dims.head_dim
    grouped = qkv.reshape(dims.num_query_groups, q_rows + 2 * dims.head_dim, hidden)
    q, k, v = grouped.split([q_rows, dims.head_dim, dims.head_dim], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(expected)} "
            "for this model config"
        )


def _unfuse_experts(hf_state: dict[str, torch.Tensor], dims: Dims) -> dict[str, torch.Tensor]:
    """transformers>=5 3-D expert tensors -> per-expert checkpoint names; other keys as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in hf_state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            _check_shape(name, tensor, (dims.num_experts, 2 * dims.moe_ffn, dims.hidden))
            for e in range(dims.num_experts):
                gate, up = tensor[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"] = gate
                out[f"{prefix}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            _check_shape(name, tensor, (dims.num_experts, dims.hidden, dims.moe_ffn))
            for e in range(dims.num_experts):
                out[f"{prefix}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def _hf_layers(hf_state: dict[str, torch.Tensor], dims: Dims) -> list[dict[str, torch.Tensor]]:
    """Split an HF state into per-layer dicts keyed by suffix, checking names and shapes."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(dims.num_layers)]
    top = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight"}
    if not dims.tied:
        top[OUTPUT] = "lm_head.weight"
    for name, tensor in hf_state.items():
        match = _HF_LAYER.fullmatch(name)
        if match and int(match.group(1)) < dims.num_layers:
            layer, suffix = int(match.group(1)), match.group(2)
            expected = hf_layer_shapes(dims, layer)
            if suffix not in expected:
                raise ValueError(f"unknown HF tensor {name!r} for a {dims.model_type} model")
            _check_shape(name, tensor, expected[suffix])
            layers[layer][suffix] = tensor
        elif name not in top.values() and not (dims.tied and name == "lm_head.weight"):
            raise ValueError(f"unknown HF tensor {name!r} for a {dims.model_type} model")
    return layers


def hf_to_megatron(
    hf_state: dict[str, torch.Tensor],
    hf_config: Any,
    spec: str = "te",
    grouped_experts: bool = False,
) -> dict[str, torch.Tensor]:
    """Megatron GPTModel state (unsharded) from an HF Qwen3 / Qwen3-MoE state.

    spec: 'te' (TransformerEngine layer spec, norms fused into linears) or 'local'.
    grouped_experts: name experts as TEGroupedMLP (`linear_fc1.weight{e}`) instead of
    SequentialMLP (`local_experts.{e}.linear_fc1.weight`).
    """
    dims = Dims.from_hf(hf_config)
    hf_state = _unfuse_experts(hf_state, dims)
    layers = _hf_layers(hf_state, dims)
    out: dict[str, torch.Tensor] = {}
    emb = _require(hf_state, "model.embed_tokens.weight")
    _check_shape("model.embed_tokens.weight", emb, (dims.vocab, dims.hidden))
    out[EMBEDDING] = emb
    for i, tensors in enumerate(layers):
        names = mcore_layer_names(dims, i, spec, grouped_experts)
        for key, tensor in _layer_to_megatron(tensors, dims, i).items():
            out[names[key]] = tensor
    norm = _require(hf_state, "model.norm.weight")
    _check_shape("model.norm.weight", norm, (dims.hidden,))
    out[FINAL_NORM] = norm
    if not dims.tied:
        head = _require(hf_state, "lm_head.weight")
        _check_shape("lm_head.weight", head, (dims.vocab, dims.hidden))
        out[OUTPUT] = head
    return out


def _require(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"HF state has no tensor {name!r}")
    return state[name]


def _layer_to_megatron(
    t: dict[str, torch.Tensor], dims: Dims, layer: int
) -> dict[str, torch.Tensor]:
    """One HF layer (suffix -> tensor) -> logical Megatron keys (see names.mcore_layer_names)."""
    missing = sorted(set(hf_layer_shapes(dims, layer)) - set(t))
    if missing:
        raise ValueError(f"HF state lacks model.layers.{layer}.{missing[0]} (and maybe more)")
    out = {
        "input_norm": t["input_layernorm.weight"],
        "qkv": merge_qkv(
            t["self_attn.q_proj.weight"],
            t["self_attn.k_proj.weight"],
            t["self_attn.v_proj.weight"],
            dims,
        ),
        "q_norm": t["self_attn.q_norm.weight"],
        "k_norm": t["self_attn.k_norm.weight"],
        "proj": t["self_attn.o_proj.weight"],
        "mlp_norm": t["post_attention_layernorm.weight"],
    }
    if is_moe_layer(dims, layer):
        out["router"] = t["mlp.gate.weight"]
        for e in range(dims.num_experts):
            gate, up = t[f"mlp.experts.{e}.gate_proj.weight"], t[f"mlp.experts.{e}.up_proj.weight"]
            out[f"expert_fc1.{e}"] = torch.cat([gate, up], dim=0)
            out[f"expert_fc2.{e}"] = t[f"mlp.experts.{e}.down_proj.weight"]
    else:
        out["fc1"] = torch.cat([t["mlp.gate_proj.weight"], t["mlp.up_proj.weight"]], dim=0)
        out["fc2"] = t["mlp.down_proj.weight"]
    return out


def megatron_to_hf_named(
    named_iter: Iterable[tuple[str, torch.Tensor]], hf_config: Any, fused_experts: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (hf_name, tensor) for each (megatron_name, tensor), so a weight sync can send bucket
    by bucket. `_extra_state` entries (TransformerEngine metadata, not weights) are skipped.

    fused_experts=False yields per-expert checkpoint names (what SGLang and HF checkpoints use);
    True yields transformers>=5's 3-D expert tensors, each once all experts of its layer passed.
    """
    dims = Dims.from_hf(hf_config)
    pending: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in named_iter:
        if name.endswith("_extra_state"):
            continue
        for hf_name, hf_tensor in _mcore_tensor_to_hf(name, tensor, dims):
            match = _HF_LAYER.fullmatch(hf_name)
            expert = _HF_EXPERT.fullmatch(match.group(2)) if (fused_experts and match) else None
            if expert is None:
                yield hf_name, hf_tensor
                continue
            layer, e, proj = int(match.group(1)), int(expert.group(1)), expert.group(2)
            kind = "down_proj" if proj == "down_proj" else "gate_up_proj"
            parts = pending.setdefault((layer, kind), {})
            parts[e * 2 + (proj == "up_proj")] = hf_tensor
            if len(parts) == dims.num_experts * (1 if kind == "down_proj" else 2):
                del pending[(layer, kind)]
                yield _fused_expert(layer, kind, parts, dims)
    if pending:
        layer, kind = next(iter(pending))
        raise ValueError(f"experts of model.layers.{layer}.mlp.experts.{kind} are incomplete")


def _fused_expert(
    layer: int, kind: str, parts: dict[int, torch.Tensor], dims: Dims
) -> tuple[str, torch.Tensor]:
    if kind == "down_proj":
        stacked = torch.stack([parts[2 * e] for e in range(dims.num_experts)])
    else:  # per expert [gate; up] along rows, as transformers' gate_up_proj
        stacked = torch.stack(
            [torch.cat([parts[2 * e], parts[2 * e + 1]]) for e in range(dims.num_experts)]
        )
    return f"model.layers.{layer}.mlp.experts.{kind}", stacked


def megatron_to_hf(
    mcore_state: dict[str, torch.Tensor], hf_config: Any, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """HF state from a full (unsharded) Megatron state; see `megatron_to_hf_named`."""
    return dict(megatron_to_hf_named(mcore_state.items(), hf_config, fused_experts))


def _mcore_tensor_to_hf(
    name: str, tensor: torch.Tensor, dims: Dims
) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors one Megatron tensor holds (QKV and fc1 split), shape-checked."""
    if name == EMBEDDING:
        _check_shape(name, tensor, (dims.vocab, dims.hidden))
        return [("model.embed_tokens.weight", tensor)]
    if name == FINAL_NORM:
        _check_shape(name, tensor, (dims.hidden,))
        return [("model.norm.weight", tensor)]
    if name == OUTPUT and not dims.tied:
        _check_shape(name, tensor, (dims.vocab, dims.hidden))
        return [("lm_head.weight", tensor)]
    match = _MC_LAYER.fullmatch(name)
    if match is None or int(match.group(1)) >= dims.num_layers:
        raise ValueError(f"unknown Megatron tensor {name!r} for a {dims.model_type} model")
    layer, suffix = int(match.group(1)), match.group(2)
    prefix = f"model.layers.{layer}."
    pairs = _layer_tensor_to_hf(suffix, tensor, dims, layer)
    if pairs is None:
        raise ValueError(f"unknown Megatron tensor {name!r} for a {dims.model_type} model")
    expected = hf_layer_shapes(dims, layer)
    for hf_suffix, hf_tensor in pairs:
        if hf_suffix not in expected:  # e.g. a router in a dense layer
            raise ValueError(f"unexpected Megatron tensor {name!r} in layer {layer}")
        _check_shape(name, hf_tensor, expected[hf_suffix])
    return [(prefix + s, t) for s, t in pairs]


def _layer_tensor_to_hf(
    suffix: str, tensor: torch.Tensor, dims: Dims, layer: int
) -> list[tuple[str, torch.Tensor]] | None:
    if suffix in _ONE_TO_ONE:
        return [(_ONE_TO_ONE[suffix], tensor)]
    if suffix == "self_attention.linear_qkv.weight":
        rows = (dims.num_heads + 2 * dims.num_query_groups) * dims.head_dim
        _check_shape(f"decoder.layers.{layer}.{suffix}", tensor, (rows, dims.hidden))
        q, k, v = split_qkv(tensor, dims)
        return [("self_attn.q_proj.weight", q), ("self_attn.k_proj.weight", k),
                ("self_attn.v_proj.weight", v)]  # fmt: skip
    if suffix == "mlp.linear_fc1.weight":
        _check_shape(f"decoder.layers.{layer}.{suffix}", tensor, (2 * dims.ffn, dims.hidden))
        gate, up = tensor.chunk(2, dim=0)
        return [("mlp.gate_proj.weight", gate), ("mlp.up_proj.weight", up)]
    expert = _MC_EXPERT.fullmatch(suffix)
    if expert is None:
        return None
    e = int(expert.group(1) or expert.group(4))
    which = expert.group(2) or expert.group(3)
    if which == "linear_fc2":
        return [(f"mlp.experts.{e}.down_proj.weight", tensor)]
    _check_shape(f"decoder.layers.{layer}.{suffix}", tensor, (2 * dims.moe_ffn, dims.hidden))
    gate, up = tensor.chunk(2, dim=0)
    return [(f"mlp.experts.{e}.gate_proj.weight", gate), (f"mlp.experts.{e}.up_proj.weight", up)]
