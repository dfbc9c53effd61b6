"""Tensor-parallel (and expert-parallel) sharding of full Megatron tensors, and its inverse.

Column-parallel (output rows split): linear_qkv (contiguous rows, i.e. whole query groups when
num_query_groups divides by tp; Megatron splits a group's rows when tp exceeds the groups),
linear_fc1 (gate and up each split, then re-concatenated per rank: [gate_r; up_r]), the vocab
rows of the embedding and output layer. Row-parallel (input columns split): linear_proj,
linear_fc2. Replicated: every norm and the MoE router. Expert tensors shard the same way over the
expert-tensor-parallel group.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import torch

from relax_core.train.megatron.names import Dims

_COLUMN = re.compile(
    r"(embedding\.word_embeddings\.weight|output_layer\.weight"
    r"|decoder\.layers\.\d+\.self_attention\.linear_qkv\.weight)"
)
_FC1 = re.compile(
    r"decoder\.layers\.\d+\.mlp\.(linear_fc1\.weight"
    r"|experts\.local_experts\.\d+\.linear_fc1\.weight|experts\.linear_fc1\.weight\d+)"
)
_ROW = re.compile(
    r"decoder\.layers\.\d+\.(self_attention\.linear_proj\.weight|mlp\.linear_fc2\.weight"
    r"|mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight|mlp\.experts\.linear_fc2\.weight\d+)"
)
_REPLICATED = re.compile(
    r"decoder\.final_layernorm\.weight|decoder\.layers\.\d+\.("
    r"self_attention\.linear_qkv\.layer_norm_weight|input_layernorm\.weight"
    r"|self_attention\.[qk]_layernorm\.weight|mlp\.linear_fc1\.layer_norm_weight"
    r"|pre_mlp_layernorm\.weight|mlp\.router\.weight)"
)
_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts\.local_experts\.)(\d+)(\..*)")
_GROUPED_EXPERT = re.compile(r"(.*\.mlp\.experts\.linear_fc[12]\.weight)(\d+)")


def tp_kind(name: str) -> str:
    """'column', 'fc1', 'row' or 'replicated': how tensor `name` is split over TP ranks."""
    for kind, pattern in (
        ("column", _COLUMN),
        ("fc1", _FC1),
        ("row", _ROW),
        ("replicated", _REPLICATED),
    ):
        if pattern.fullmatch(name):
            return kind
    raise ValueError(f"unknown Megatron tensor {name!r}: no tensor-parallel rule for it")


def check_tp_heads(hf_config: Any, tp_size: int) -> None:
    """Megatron's rule: heads divide by tp; query groups are a multiple or a divisor of tp."""
    dims = Dims.from_hf(hf_config)
    if dims.num_heads % tp_size:
        raise ValueError(
            f"num_attention_heads ({dims.num_heads}) is not divisible by tensor parallel size "
            f"{tp_size}"
        )
    if dims.num_query_groups % tp_size and tp_size % dims.num_query_groups:
        raise ValueError(
            f"num_key_value_heads ({dims.num_query_groups}) must be a multiple or a divisor of "
            f"tensor parallel size {tp_size}"
        )


def shard_for_tp(
    name: str, tensor: torch.Tensor, tp_size: int, tp_rank: int, *, hf_config: Any = None
) -> torch.Tensor:
    """Rank `tp_rank`'s shard of full tensor `name`. With `hf_config`, also checks the attention
    heads against `tp_size` (see `check_tp_heads`)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad tensor parallel rank {tp_rank} of size {tp_size} for {name!r}")
    kind = tp_kind(name)
    if hf_config is not None and name.endswith("linear_qkv.weight"):
        check_tp_heads(hf_config, tp_size)
    if kind == "replicated":
        return tensor
    dim = 1 if kind == "row" else 0
    if kind == "fc1":
        if tensor.shape[0] % (2 * tp_size):
            raise ValueError(
                f"{name!r}: {tensor.shape[0]} fc1 rows do not split into gate/up halves over "
                f"tensor parallel size {tp_size}"
            )
        gate, up = tensor.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]]).contiguous()
    if tensor.shape[dim] % tp_size:
        raise ValueError(
            f"{name!r}: dimension {dim} ({tensor.shape[dim]}) is not divisible by tensor "
            f"parallel size {tp_size}"
        )
    return tensor.chunk(tp_size, dim=dim)[tp_rank].contiguous()


def full_shape(name: str, local_shape: Sequence[int], tp_size: int) -> tuple[int, ...]:
    """The shape of full tensor `name` whose TP shard has `local_shape` (see `tp_kind`)."""
    shape = list(local_shape)
    kind = tp_kind(name)
    if kind != "replicated":
        shape[1 if kind == "row" else 0] *= tp_size
    return tuple(shape)


def gather_from_tp(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every TP rank's shard of `name`, in rank order."""
    if not shards:
        raise ValueError(f"no shards given for {name!r}")
    kind = tp_kind(name)
    if kind == "replicated":
        if any(not torch.equal(shards[0], s) for s in shards[1:]):
            raise ValueError(f"replicated tensor {name!r} differs between tensor parallel ranks")
        return shards[0]
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(list(shards), dim=1 if kind == "row" else 0)


def expert_index(name: str) -> int | None:
    """The expert number in a Megatron expert tensor name, None for other tensors."""
    match = _LOCAL_EXPERT.fullmatch(name)
    if match:
        return int(match.group(2))
    match = _GROUPED_EXPERT.fullmatch(name)
    return int(match.group(2)) if match else None


def renumber_expert(name: str, new_index: int) -> str:
    """`name` with its expert number replaced (global <-> local index under expert parallel)."""
    match = _LOCAL_EXPERT.fullmatch(name)
    if match:
        return f"{match.group(1)}{new_index}{match.group(3)}"
    match = _GROUPED_EXPERT.fullmatch(name)
    if match:
        return f"{match.group(1)}{new_index}"
    raise ValueError(f"{name!r} is not a Megatron expert tensor")
