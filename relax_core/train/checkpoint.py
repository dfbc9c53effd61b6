"""Resumable checkpoints: one directory per policy version, written whole or not at all.

Layout: `{checkpoint.dir}/{run_id}/step_{version:06d}/` holding the HF model (safetensors), the
tokenizer, the backend's optimizer state (tensors only, loaded with weights_only=True) and
`state.json` (policy version, dataset cursor, queue cursors, RNG states, tracking run id).
`checkpoint.dir` is a local directory or a URL (s3://bucket/prefix/checkpoints). state.json is
the commit marker: staged and renamed into place on local disk, uploaded after every other file
on an object store (storage/dirs.py), so a crash never leaves a half checkpoint that looks
complete. Resume takes the newest committed one; pruning never removes it.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable
from typing import Any

import torch

from relax_core.queue.store import ObjectStore
from relax_core.storage import (
    join,
    local_copy,
    publish_dir,
    read_json,
    remove_dir,
    where,
)

STATE_FILE = "state.json"
FINAL_CHECKPOINT = "final_checkpoint.json"
"""In a run's directory: {"checkpoint": where} once the async trainer has trained every step."""
_PREFIX = "step_"
_STEP = re.compile(rf"^{_PREFIX}\d+$")


def step_dir_name(version: int) -> str:
    return f"{_PREFIX}{version:06d}"


def save_checkpoint(
    run_dir: str,
    version: int,
    write_model: Callable[[str], None],
    state: dict[str, Any],
    keep: int,
    options: dict | None = None,
    scratch_dir: str = "",
) -> str:
    """Publish `run_dir/step_{version}` whole; prune to the newest `keep`. Returns where it is."""

    def build(staging: str) -> dict[str, Any]:
        write_model(staging)
        return state

    final = publish_dir(
        join(run_dir, step_dir_name(version)), STATE_FILE, build, options, scratch_dir
    )
    names, done = _steps(run_dir, options)
    committed = [join(where(run_dir), n) for n in done]
    for old in committed[: max(0, len(committed) - max(1, keep))]:
        remove_dir(old, STATE_FILE, options)
    # Step directories without a marker older than the newest committed one are uploads a
    # killed trainer left half done (newer ones may be an upload in progress).
    for orphan in (n for n in names if n not in done and done and n < done[-1]):
        remove_dir(join(where(run_dir), orphan), STATE_FILE, options)
    return final


def list_checkpoints(run_dir: str, options: dict | None = None) -> list[str]:
    """Committed checkpoints of a run, oldest first."""
    return [join(where(run_dir), n) for n in _steps(run_dir, options)[1]]


def _steps(run_dir: str, options: dict | None) -> tuple[list[str], list[str]]:
    """(every step directory, the committed ones) of a run, by name, oldest first."""
    store = ObjectStore(run_dir, options)
    names = sorted(n for n in store.list_dir("") if _STEP.match(n))
    if store.is_local:
        return names, [n for n in names if store.exists(f"{n}/{STATE_FILE}")]
    found = store.read_many([f"{n}/{STATE_FILE}" for n in names], max_bytes=1)
    return names, [n for n in names if f"{n}/{STATE_FILE}" in found]


def read_state(checkpoint: str, options: dict | None = None) -> dict[str, Any]:
    try:
        return read_json(join(checkpoint, STATE_FILE), options)
    except FileNotFoundError:
        raise FileNotFoundError(f"{checkpoint} is not a checkpoint (no {STATE_FILE})") from None


def local_checkpoint(
    checkpoint: str,
    options: dict | None = None,
    scratch_dir: str = "",
    exclude: tuple[str, ...] = (),
) -> str:
    """A local directory holding `checkpoint` (itself if local; else copied once into scratch,
    without the files or folders in `exclude`, e.g. optimizer state a role never loads)."""
    return local_copy(checkpoint, STATE_FILE, options, scratch_dir, exclude)


def find_resume_checkpoint(
    checkpoint_root: str, run_name: str, options: dict | None = None
) -> str | None:
    """Newest checkpoint of the newest run named `<run_name>-<timestamp>` that has one."""
    store = ObjectStore(checkpoint_root, options)
    runs = sorted((n for n in store.list_dir("") if n.startswith(f"{run_name}-")), reverse=True)
    for run in runs:
        found = list_checkpoints(join(where(checkpoint_root), run), options)
        if found:
            return found[-1]
    return None


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state (uint8 tensor) as base64 text for state.json."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
