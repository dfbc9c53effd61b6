"""Resumable checkpoints: one directory per policy version, written whole or not at all.

Layout: `{checkpoint_dir}/{run_id}/step_{version:06d}/` holding the HF model (safetensors), the
tokenizer, `optimizer.pt` (tensors only, loaded with weights_only=True) and `state.json` (policy
version, dataset cursor, queue cursors, RNG states, tracking run id). A checkpoint is staged in a
temporary sibling directory and renamed into place, so a crash never leaves a half checkpoint
that looks complete.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.json"
_PREFIX = "step_"


def step_dir_name(version: int) -> str:
    return f"{_PREFIX}{version:06d}"


def save_checkpoint(
    run_dir: str, version: int, write_model: Callable[[str], None], state: dict[str, Any], keep: int
) -> str:
    """Stage, then publish `run_dir/step_{version}`; prune to the newest `keep`. Returns its path."""
    os.makedirs(run_dir, exist_ok=True)
    final = os.path.join(run_dir, step_dir_name(version))
    staging = os.path.join(run_dir, f".tmp-{uuid.uuid4().hex}")
    os.makedirs(staging)
    try:
        write_model(staging)
        with open(os.path.join(staging, STATE_FILE), "w") as f:
            json.dump(state, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same version re-saved after a resume
            shutil.rmtree(final)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: str) -> list[str]:
    """Complete checkpoints of a run, oldest first."""
    if not os.path.isdir(run_dir):
        return []
    names = sorted(n for n in os.listdir(run_dir) if n.startswith(_PREFIX))
    return [
        os.path.join(run_dir, n)
        for n in names
        if os.path.isfile(os.path.join(run_dir, n, STATE_FILE))
    ]


def read_state(checkpoint: str) -> dict[str, Any]:
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint (no {STATE_FILE})")
    with open(path) as f:
        return json.load(f)


def find_resume_checkpoint(checkpoint_root: str, run_name: str) -> str | None:
    """Newest checkpoint of the newest run named `<run_name>-<timestamp>` that has one."""
    root = Path(checkpoint_root)
    if not root.is_dir():
        return None
    runs = sorted(
        (p for p in root.iterdir() if p.is_dir() and p.name.startswith(f"{run_name}-")),
        key=lambda p: p.name,
        reverse=True,
    )
    for run in runs:
        found = list_checkpoints(str(run))
        if found:
            return found[-1]
    return None


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state (uint8 tensor) as base64 text for state.json."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
