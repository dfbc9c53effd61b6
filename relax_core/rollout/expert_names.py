"""MoE experts between transformers' in-memory layout and the checkpoint names engines load.

transformers 5 holds an MoE layer's experts fused: `...mlp.experts.gate_up_proj` [E, 2I, H]
(gate rows first, then up) and `...mlp.experts.down_proj` [E, H, I]. Checkpoints, and SGLang's
`load_weights` for Qwen2/Qwen3-MoE (its expert mapping takes `experts.{e}.gate_proj.weight` and
the like), name each expert's matrices apart: `...mlp.experts.{e}.gate_proj.weight` [I, H],
`up_proj.weight` [I, H], `down_proj.weight` [H, I]. Trainer backends publish the in-memory layout
(what torch engines and actor_fwd hold); what reaches an SGLang server (its weight group, or a
colocated server's handover) is turned into checkpoint names here, one fused tensor at a time.
Dense models pass through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]

_FUSED = re.compile(r"(?P<prefix>.*\.mlp\.experts)\.(?P<kind>gate_up_proj|down_proj)")


def checkpoint_layout(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the checkpoint tensors the in-memory tensor `name` of `shape` is: its
    experts' matrices for a fused expert tensor, else itself."""
    match = _FUSED.fullmatch(name)
    return [(name, tuple(shape))] if match is None else _split_shapes(match, tuple(shape))


def checkpoint_names(named_tensors: NamedTensors) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `named_tensors` under checkpoint names: fused experts split per expert
    (views, no copies), everything else as it comes."""
    for name, tensor in named_tensors:
        match = _FUSED.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix = match["prefix"]
        if match["kind"] == "down_proj":
            for e in range(tensor.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", tensor[e]
            continue
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            yield f"{prefix}.{e}.gate_proj.weight", tensor[e, :half]
            yield f"{prefix}.{e}.up_proj.weight", tensor[e, half:]


def _split_shapes(match: re.Match, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    if len(shape) != 3:
        raise ValueError(
            f"{match.string}: a fused expert tensor is [experts, rows, cols], got {list(shape)}"
        )
    experts, rows, cols = shape
    prefix = match["prefix"]
    if match["kind"] == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", (rows, cols)) for e in range(experts)]
    if rows % 2:
        raise ValueError(f"{match.string}: gate_up rows must be even (gate then up), got {rows}")
    out = []
    for e in range(experts):
        out.append((f"{prefix}.{e}.gate_proj.weight", (rows // 2, cols)))
        out.append((f"{prefix}.{e}.up_proj.weight", (rows // 2, cols)))
    return out
