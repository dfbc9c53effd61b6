"""Float32 master weights beside a checkpoint's narrower policy: written by a trainer whose
parameters are wider than what engines receive, read back on resume (torch and FSDP backends)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
from safetensors.torch import load_file, save_file

from relax_core.train.backend import MASTER_WEIGHTS_FILE


def save_master_weights(named_params: Iterator[tuple[str, torch.Tensor]], directory: str) -> None:
    """Float32 weights by parameter name (tied parameters once) into MASTER_WEIGHTS_FILE."""
    tensors = {n: p.detach().to("cpu", torch.float32).contiguous() for n, p in named_params}
    save_file(tensors, os.path.join(directory, MASTER_WEIGHTS_FILE))


def read_master_weights(path: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The float32 master weights at `path`, which must hold exactly the parameters `names` (a
    checkpoint saved without them cannot resume without losing precision)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} missing: the checkpoint has optimizer state but no float32 master weights "
            "(saved by a trainer whose parameters were in model.dtype); resume it with "
            "model.dtype float32 or from a checkpoint written with master weights"
        )
    saved = load_file(path)
    if set(saved) != set(names):
        raise ValueError(
            f"{path} does not match the policy: missing {sorted(set(names) - set(saved))[:3]}, "
            f"unexpected {sorted(set(saved) - set(names))[:3]}"
        )
    return saved


def load_master_weights(model: torch.nn.Module, path: str) -> None:
    """Copy the master weights at `path` into `model`'s parameters."""
    params = dict(model.named_parameters())
    saved = read_master_weights(path, list(params))
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(saved[name])
