"""Moving weights between HF names and a (tensor/expert-parallel) Megatron GPTModel.

`load_into` fills this rank's shards one Megatron parameter at a time from HF tensors read on
demand (checkpoint.py): a rank reads only the tensors its own parameters are made of (its own
experts, never the others') and holds one full tensor at a time.

`stream_full_params` hands rank 0 every full Megatron tensor, one parameter at a time: gathered
to rank 0 over its tensor-parallel group (experts: over the expert-tensor-parallel group, then
the expert-parallel group). Only the ranks holding a part of what rank 0 needs take part (data
parallel rank 0 for dense tensors, expert-data-parallel rank 0 for experts); no rank holds more
than one parameter's full tensor (an expert-parallel gather: that local expert of every EP
rank). `full_param_layout` gives the same names in the same order with meta tensors of the full
shapes, without collectives, so a weight sync can plan its buckets before any weights move.
Every rank must iterate `stream_full_params` to the end in step: the gathers pair up by position.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from relax_core.train.megatron.assemble import ReadHF, mcore_tensor_from_hf
from relax_core.train.megatron.checkpoint import state_reader
from relax_core.train.megatron.names import Dims
from relax_core.train.megatron.shard import (
    expert_index,
    full_shape,
    gather_from_tp,
    renumber_expert,
    shard_for_tp,
    tp_kind,
)


def _groups():
    """(group, size, rank in group) for the tp, expert-tp and ep groups."""
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


def _global_expert_names(name: str, local: int, ep_size: int, local_experts: int) -> list[str]:
    """`name` (local expert `local`) renamed for that local expert of each EP rank, in rank order."""
    return [renumber_expert(name, r * local_experts + local) for r in range(ep_size)]


@torch.no_grad()
def load_into(model: torch.nn.Module, read: ReadHF, hf_config: Any, spec: str) -> None:
    """Copy this rank's shard of every tensor of `model` (a GPTModel) from the HF tensors `read`
    gives, one Megatron tensor at a time."""
    dims = Dims.from_hf(hf_config)
    groups = _groups()
    _, ep_size, ep_rank = groups["ep"]
    local_experts = _num_local_experts(hf_config, ep_size)
    for name, target in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        e = expert_index(name)
        source = name if e is None else renumber_expert(name, ep_rank * local_experts + e)
        _, size, rank = groups["tp" if e is None else "etp"]
        full = mcore_tensor_from_hf(source, read, dims, spec)
        shard = shard_for_tp(source, full, size, rank, hf_config=hf_config)
        if shard.shape != target.shape:
            raise ValueError(
                f"HF weights do not fit the model: {name!r} is {tuple(target.shape)} on this "
                f"rank, its shard of {source!r} {tuple(shard.shape)}"
            )
        target.copy_(shard)


def load_hf_into(
    model: torch.nn.Module, hf_state: dict[str, torch.Tensor], hf_config: Any, spec: str
) -> None:
    """`load_into` from an in-memory HF state (either expert layout)."""
    load_into(model, state_reader(hf_state), hf_config, spec)


def full_param_layout(model: torch.nn.Module, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """(megatron name, meta tensor of the full shape and the parameter's dtype) in the order
    `stream_full_params` yields them. Local: no collectives."""
    groups = _groups()
    _, ep_size, _ = groups["ep"]
    local_experts = _num_local_experts(hf_config, ep_size)
    for name, param in model.named_parameters():
        e = expert_index(name)
        size = groups["tp" if e is None else "etp"][1]
        meta = torch.empty(full_shape(name, param.shape, size), dtype=param.dtype, device="meta")
        names = [name] if e is None else _global_expert_names(name, e, ep_size, local_experts)
        for full_name in names:
            yield full_name, meta


def _gather_to_first(tensor: torch.Tensor, group: Any, size: int, rank: int):
    """Every member's `tensor` on the group's first rank (a list in group order); None on the
    others."""
    if size == 1:
        return [tensor]
    import torch.distributed as dist

    out = [torch.empty_like(tensor) for _ in range(size)] if rank == 0 else None
    dist.gather(tensor.contiguous(), out, dst=dist.get_global_rank(group, 0), group=group)
    return out


def _full_on_first(name: str, param: torch.Tensor, group: Any, size: int, rank: int):
    """The full tensor of TP-sharded `name` on the group's first rank, None on the others.
    Replicated tensors (norms, router) are the same on every TP rank: no collective."""
    if tp_kind(name) == "replicated":
        return param if rank == 0 else None
    shards = _gather_to_first(param, group, size, rank)
    return None if shards is None else gather_from_tp(name, shards)


def _gather_roles() -> tuple[bool, bool, bool]:
    """(this rank yields, takes part in dense gathers, takes part in expert gathers)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    lead = not dist.is_initialized() or dist.get_rank() == 0
    return lead, ps.get_data_parallel_rank() == 0, ps.get_expert_data_parallel_rank() == 0


@torch.no_grad()
def stream_full_params(
    model: torch.nn.Module, hf_config: Any
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank 0: (megatron name, full tensor) for every parameter of `model`, one at a time, in
    `full_param_layout`'s order. Other ranks yield nothing but take part in the gathers."""
    groups = _groups()
    lead, dense_part, expert_part = _gather_roles()
    ep_group, ep_size, ep_rank = groups["ep"]
    local_experts = _num_local_experts(hf_config, ep_size)
    for name, param in model.named_parameters():
        e = expert_index(name)
        if not (dense_part if e is None else expert_part):
            continue
        full = _full_on_first(name, param.detach(), *groups["tp" if e is None else "etp"])
        if full is None:  # not the first TP rank; its EP group is all such ranks too
            continue
        if e is None:
            if lead:
                yield name, full
            continue
        parts = _gather_to_first(full, ep_group, ep_size, ep_rank)
        del full
        if lead:
            names = _global_expert_names(name, e, ep_size, local_experts)
            while parts:  # hand each expert over and let it go
                yield names[len(names) - len(parts)], parts.pop(0)


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
        if not write:
            continue  # only drains the iterator
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
