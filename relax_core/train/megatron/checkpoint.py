"""Reading HF weights tensor by tensor, by per-expert checkpoint name (assemble.ReadHF).

`SafetensorsCheckpoint` reads a policy directory's safetensors files lazily (safe_open: each
request reads that tensor's bytes only, or one expert's rows of a fused expert tensor), so a
rank loading its shards reads what it owns and holds one tensor at a time; ranks on one node
share the files through the page cache. `state_reader` serves the same requests from an
in-memory state dict. Both accept either expert layout: per-expert checkpoint names
(`mlp.experts.{e}.gate_proj.weight`, what transformers 5 `save_pretrained` writes and HF Hub
checkpoints hold) or transformers 5's fused in-memory tensors (`mlp.experts.gate_up_proj`
[E, 2I, H] with each expert's rows [gate; up], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from relax_core.train.megatron.assemble import ReadHF

_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def fused_source(name: str) -> tuple[str, int, str] | None:
    """(fused tensor name, expert, 'gate'|'up'|'down') holding per-expert tensor `name`."""
    match = _EXPERT.fullmatch(name)
    if match is None:
        return None
    prefix, expert, part = match.group(1), int(match.group(2)), match.group(3)
    return prefix + ("down_proj" if part == "down" else "gate_up_proj"), expert, part


def _expert_rows(expert_tensor: torch.Tensor, part: str) -> torch.Tensor:
    """gate or up half of one expert's [2I, H] gate_up rows; down_proj [H, I] as it is."""
    if part == "down":
        return expert_tensor
    gate, up = expert_tensor.chunk(2, dim=0)
    return gate if part == "gate" else up


def state_reader(hf_state: Mapping[str, torch.Tensor]) -> ReadHF:
    """Per-expert-name reads from an in-memory HF state (views, no copies)."""

    def read(name: str) -> torch.Tensor:
        if name in hf_state:
            return hf_state[name]
        fused = fused_source(name)
        if fused is None or fused[0] not in hf_state:
            raise KeyError(name)
        fused_name, expert, part = fused
        if expert >= hf_state[fused_name].shape[0]:
            raise KeyError(name)
        return _expert_rows(hf_state[fused_name][expert], part)

    return read


class SafetensorsCheckpoint:
    """The HF weights of `directory` (model.safetensors, or shards named by the index file)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._handles: dict[str, Any] = {}
        index = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index):
            with open(index) as f:
                self.weight_map: dict[str, str] = dict(json.load(f)["weight_map"])
        elif os.path.exists(single):
            self.weight_map = dict.fromkeys(self._open(SINGLE_FILE).keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(
                f"{directory} holds no HF safetensors weights ({INDEX_FILE} or {SINGLE_FILE}); "
                "the Megatron backend loads a policy saved with save_pretrained"
            )

    def _open(self, file: str) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(os.path.join(self.directory, file), framework="pt")
        return self._handles[file]

    def __call__(self, name: str) -> torch.Tensor:
        if name in self.weight_map:
            return self._open(self.weight_map[name]).get_tensor(name)
        fused = fused_source(name)
        if fused is None or fused[0] not in self.weight_map:
            raise KeyError(name)
        fused_name, expert, part = fused
        rows = self._open(self.weight_map[fused_name]).get_slice(fused_name)
        if expert >= rows.get_shape()[0]:
            raise KeyError(name)
        return _expert_rows(rows[expert : expert + 1][0], part).clone()

    def close(self) -> None:
        """Drop the open files (their maps); reads after this reopen them."""
        self._handles.clear()
