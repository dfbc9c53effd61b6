"""One full (unsharded) Megatron tensor from the HF tensors it is made of, read on demand.

The per-tensor form of `convert.hf_to_megatron`: a rank loading its shards asks for each of its
own Megatron parameters in turn, and only the HF tensors that parameter needs are read (a
rank's own experts, never the others'), so no rank holds more than one full tensor at a time.
Pure torch; names as convert.py documents them.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

from relax_core.train.megatron.convert import merge_qkv
from relax_core.train.megatron.names import (
    EMBEDDING,
    FINAL_NORM,
    OUTPUT,
    Dims,
    hf_layer_shapes,
    mcore_layer_names,
)

ReadHF = Callable[[str], torch.Tensor]
"""HF tensor name (per-expert checkpoint names) -> the tensor; KeyError when it is absent."""

_MC_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

# Logical key (names.mcore_layer_names) -> the one HF layer suffix it copies.
_ONE_TO_ONE = {
    "input_norm": "input_layernorm.weight",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "proj": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "fc2": "mlp.down_proj.weight",
    "router": "mlp.gate.weight",
}


@functools.lru_cache(maxsize=256)
def _logical_keys(dims: Dims, layer: int, spec: str) -> dict[str, str]:
    """Megatron layer suffix -> logical key, both expert namings (SequentialMLP and grouped)."""
    prefix = f"decoder.layers.{layer}."
    keys = {}
    for grouped in (False, True):
        for key, name in mcore_layer_names(dims, layer, spec, grouped).items():
            keys[name.removeprefix(prefix)] = key
    return keys


def hf_sources(name: str, dims: Dims, spec: str) -> list[str]:
    """The HF tensor names Megatron tensor `name` is made of, in the order it joins them."""
    top = {EMBEDDING: "model.embed_tokens.weight", FINAL_NORM: "model.norm.weight"}
    if not dims.tied:
        top[OUTPUT] = "lm_head.weight"
    if name in top:
        return [top[name]]
    match = _MC_LAYER.fullmatch(name)
    key = None
    if match and int(match.group(1)) < dims.num_layers:
        key = _logical_keys(dims, int(match.group(1)), spec).get(match.group(2))
    if key is None:
        raise ValueError(f"unknown Megatron tensor {name!r} for a {dims.model_type} {spec} model")
    p = f"model.layers.{match.group(1)}."
    if key == "qkv":
        return [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
    if key == "fc1":
        return [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
    if key.startswith("expert_fc"):
        e = key.split(".")[1]
        if key.startswith("expert_fc1."):
            return [p + f"mlp.experts.{e}.gate_proj.weight", p + f"mlp.experts.{e}.up_proj.weight"]
        return [p + f"mlp.experts.{e}.down_proj.weight"]
    return [p + _ONE_TO_ONE[key]]


def _expected_shape(hf_name: str, dims: Dims) -> tuple[int, ...]:
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (dims.vocab, dims.hidden)
    if hf_name == "model.norm.weight":
        return (dims.hidden,)
    _, _, layer, suffix = hf_name.split(".", 3)  # model.layers.{i}.{suffix}
    return hf_layer_shapes(dims, int(layer))[suffix]


def mcore_tensor_from_hf(name: str, read: ReadHF, dims: Dims, spec: str) -> torch.Tensor:
    """Full Megatron tensor `name` built from the HF tensors `read` gives (shape-checked)."""
    parts = []
    for hf_name in hf_sources(name, dims, spec):
        try:
            tensor = read(hf_name)
        except KeyError:
            raise ValueError(f"HF state has no tensor {hf_name!r} (for {name!r})") from None
        expected = _expected_shape(hf_name, dims)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected {expected} "
                "for this model config"
            )
        parts.append(tensor)
    if len(parts) == 3:
        return merge_qkv(*parts, dims)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
