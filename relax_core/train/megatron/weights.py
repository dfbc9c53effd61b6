"""Moving weights between HF names and a (tensor/expert-parallel) Megatron GPTModel.

`load_hf_into` gives each rank its shard of an HF state; `gathered_megatron` yields every full
Megatron tensor on every rank (all-gather over TP, then over EP for experts), one at a time, so
`megatron_to_hf_named` can turn the stream into HF names for a weight sync or `save_hf`.
Every rank must iterate the gather in the same order: the collectives pair up by position.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from relax_core.train.megatron.convert import hf_to_megatron
from relax_core.train.megatron.shard import (
    expert_index,
    gather_from_tp,
    renumber_expert,
    shard_for_tp,
)


def _groups():
    """(tp group, expert-tp group, ep group) with their sizes and this rank's positions."""
    from megatron.core import parallel_state as ps

    return {
        "tp": (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size(),
               ps.get_tensor_model_parallel_rank()),
        "etp": (ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_rank()),
        "ep": (ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size(),
               ps.get_expert_model_parallel_rank()),
    }  # fmt: skip


def _num_local_experts(hf_config: Any, ep_size: int) -> int:
    return (getattr(hf_config, "num_experts", 0) or 0) // ep_size


def load_hf_into(
    model: torch.nn.Module, hf_state: dict[str, torch.Tensor], hf_config: Any, spec: str
) -> None:
    """Copy this rank's shard of every tensor of `hf_state` into `model` (a GPTModel)."""
    full = hf_to_megatron(hf_state, hf_config, spec=spec)
    groups = _groups()
    _, ep_size, ep_rank = groups["ep"]
    local_experts = _num_local_experts(hf_config, ep_size)
    own = model.state_dict()
    shards: dict[str, torch.Tensor] = {}
    for name in own:
        if name.endswith("_extra_state"):
            continue
        e = expert_index(name)
        source = name if e is None else renumber_expert(name, ep_rank * local_experts + e)
        _, size, rank = groups["tp" if e is None else "etp"]
        if source not in full:
            raise ValueError(f"the converted HF state has no {source!r} for the Megatron model")
        shards[name] = shard_for_tp(source, full[source], size, rank, hf_config=hf_config)
    result = model.load_state_dict(shards, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"HF weights do not fit the model: missing {missing[:3]}, "
                         f"unexpected {result.unexpected_keys[:3]}")  # fmt: skip


def _all_gather(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor.contiguous(), group=group)
    return out


def gathered_megatron(model: torch.nn.Module, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, full tensor) for every parameter of `model`, on every rank."""
    groups = _groups()
    ep_group, ep_size, _ = groups["ep"]
    local_experts = _num_local_experts(hf_config, ep_size)
    for name, param in model.named_parameters():
        tensor = param.detach()
        e = expert_index(name)
        group, size, _ = groups["tp" if e is None else "etp"]
        full = gather_from_tp(name, _all_gather(tensor, group, size))
        if e is None:
            yield name, full
            continue
        for ep_rank, part in enumerate(_all_gather(full, ep_group, ep_size)):
            yield renumber_expert(name, ep_rank * local_experts + e), part


def write_safetensors(
    named: Iterator[tuple[str, torch.Tensor]], directory: str, write: bool, shard_bytes: int
) -> None:
    """Write HF-named tensors as safetensors shards of at most `shard_bytes` plus the index file
    transformers reads. Ranks with write=False only drain the iterator (its collectives)."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    total = 0

    def flush() -> None:
        nonlocal bucket, size
        if bucket and write:
            file = f"model-{len(set(weight_map.values())):05d}.safetensors"
            save_file(bucket, os.path.join(directory, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, file))
        bucket, size = {}, 0

    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > shard_bytes:
            flush()
        bucket[name] = tensor.to("cpu", copy=True).contiguous()
        size += nbytes
        total += nbytes
    flush()
    if write:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
