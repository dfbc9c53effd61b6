"""Resumable checkpoints: one directory per policy version, written whole or not at all.

Layout: `{checkpoint.dir}/{run_id}/step_{version:06d}/` holding the HF model (safetensors), the
tokenizer, the backend's optimizer state (tensors only, loaded with weights_only=True) and
`state.json` (policy version, dataset cursor, queue cursors, RNG states, tracking run id).
`checkpoint.dir` is a local directory or a URL (s3://bucket/prefix/checkpoints). state.json is
the commit marker: staged and renamed into place on local disk, uploaded after every other file
on an object store (storage/dirs.py), so a crash never leaves a half checkpoint that looks
complete. It lists every file with its size and sha256, and resume verifies the checkpoint it
takes against that list: a corrupt one is refused with the file named, or skipped for the newest
that verifies when `checkpoint.fallback_to_previous` is set. Pruning keeps the checkpoint just
written and never removes one in favour of a newer one a resume abandoned. A full disk while
writing is an error naming the place, with nothing half-written left behind.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import re
from collections.abc import Callable
from typing import Any

import torch

from relax_core.queue.store import ObjectStore
from relax_core.storage import (
    is_committed,
    is_disk_full,
    is_local,
    join,
    local_copy,
    parent,
    publish_dir,
    read_json,
    remove_dir,
    scratch_root,
    verify_dir,
    where,
)

log = logging.getLogger(__name__)

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
    """Publish `run_dir/step_{version}` whole; prune to the newest `keep`. Returns where it is.
    A full disk raises OSError(ENOSPC) naming the place and the newest complete checkpoint."""

    def build(staging: str) -> dict[str, Any]:
        write_model(staging)
        return state

    target = join(run_dir, step_dir_name(version))
    try:
        final = publish_dir(target, STATE_FILE, build, options, scratch_dir)
    except Exception as exc:
        if not is_disk_full(exc):
            raise
        raise OSError(errno.ENOSPC, _disk_full(target, run_dir, options, scratch_dir)) from exc
    # Only checkpoints older than this one are pruned: newer ones belong to a line a resume from
    # an earlier checkpoint abandoned (one skipped as corrupt, say), and are replaced as this
    # run reaches their versions again; counting them would prune what this run just wrote.
    name = step_dir_name(version)
    names, done = _steps(run_dir, options)
    kept = [n for n in done if n <= name]
    for old in kept[: max(0, len(kept) - max(1, keep))]:
        remove_dir(join(where(run_dir), old), STATE_FILE, options)
    # Step directories without a marker older than this one are uploads a killed trainer left
    # half done (newer ones may be an upload in progress).
    for orphan in (n for n in names if n not in done and n < name):
        remove_dir(join(where(run_dir), orphan), STATE_FILE, options)
    return final


def _disk_full(target: str, run_dir: str, options: dict | None, scratch_dir: str) -> str:
    newest = newest_complete(list_checkpoints(run_dir, options)[::-1], options, fallback=True)
    kept = (
        f"the newest complete checkpoint is {newest} (checkpoint.resume: true continues from it)"
        if newest
        else "this run has no complete checkpoint yet"
    )
    if is_local(target):
        return (
            f"no space left on device writing checkpoint {target} "
            f"(checkpoint.dir={parent(where(run_dir))}): free space or point checkpoint.dir "
            f"elsewhere; {kept}"
        )
    return (
        f"no space left on device staging checkpoint {target} in {scratch_root(scratch_dir)}: "
        f"free space there or point storage.scratch_dir elsewhere; {kept}"
    )


def list_checkpoints(run_dir: str, options: dict | None = None) -> list[str]:
    """Committed checkpoints of a run (their state.json is there), oldest first. Not verified:
    `newest_complete` checks the one a resume takes."""
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
    checkpoint_root: str, run_name: str, options: dict | None = None, fallback: bool = False
) -> str | None:
    """Newest complete checkpoint of the newest run named `<run_name>-<timestamp>` that has one.
    A corrupt newest one raises CorruptCheckpoint, or is skipped with a warning if `fallback`."""
    store = ObjectStore(checkpoint_root, options)
    runs = sorted((n for n in store.list_dir("") if n.startswith(f"{run_name}-")), reverse=True)
    newest_first = [
        c
        for run in runs
        for c in list_checkpoints(join(where(checkpoint_root), run), options)[::-1]
    ]
    return newest_complete(newest_first, options, fallback)


def resume_checkpoint(
    run_dir: str, options: dict | None = None, fallback: bool = False
) -> str | None:
    """The newest complete checkpoint of a run (what a retried node or a restarted role resumes);
    None if the run has none committed. CorruptCheckpoint if the newest is corrupt and not
    `fallback`, or if none is complete."""
    found = list_checkpoints(run_dir, options)[::-1]
    chosen = newest_complete(found, options, fallback)
    if found and chosen is None:
        problems = "; ".join(verify_checkpoint(c, options) for c in found)
        raise CorruptCheckpoint(f"no checkpoint of {run_dir} is complete: {problems}")
    return chosen


class CorruptCheckpoint(RuntimeError):
    """A checkpoint whose files do not match its state.json; the message names the file."""


_verified: dict[str, tuple] = {}
"""Local checkpoints this process verified -> the stat of each of their files then. A supervisor
asks for the newest checkpoint at every role start; hashing it each time would cost as much as
loading it, while a stat finds a file truncated, replaced or written since."""


def verify_checkpoint(checkpoint: str, options: dict | None = None) -> str:
    """What is wrong with `checkpoint`, "" when it is complete: state.json there and every file it
    lists there with its size and sha256 (on an object store sizes; the download checks hashes)."""
    path = where(checkpoint)
    key = _stat_key(path) if is_local(checkpoint) else None
    if key is not None and _verified.get(path) == key:
        return ""
    problem = verify_dir(checkpoint, STATE_FILE, options)
    if not problem and key is not None:
        _verified[path] = key
    return problem


def _stat_key(directory: str) -> tuple | None:
    out = []
    try:
        for base, _, names in os.walk(directory):
            for name in names:
                st = os.stat(os.path.join(base, name))
                out.append((base, name, st.st_ino, st.st_size, st.st_mtime_ns))
    except OSError:
        return None
    return tuple(sorted(out))


def newest_complete(
    newest_first: list[str], options: dict | None = None, fallback: bool = False
) -> str | None:
    """The first of `newest_first` that verifies. A corrupt one before it raises CorruptCheckpoint
    naming the bad file and the checkpoint to resume instead, or with `fallback` is skipped with
    a warning naming the bad file."""
    for i, checkpoint in enumerate(newest_first):
        problem = verify_checkpoint(checkpoint, options)
        if not problem:
            return checkpoint
        if not is_committed(checkpoint, STATE_FILE, options):
            continue  # pruned since it was listed (a trainer writes on): gone, not corrupt
        if not fallback:
            rest = newest_first[i + 1 :]
            previous = next((c for c in rest if not verify_checkpoint(c, options)), None)
            raise CorruptCheckpoint(refusal(problem, previous))
        log.warning("skipping corrupt checkpoint %s: %s", checkpoint, problem)
    return None


def previous_complete(checkpoint: str, options: dict | None = None) -> str | None:
    """The newest complete checkpoint of the same run older than `checkpoint`."""
    name = os.path.basename(where(checkpoint))
    older = [c for c in list_checkpoints(parent(checkpoint), options) if os.path.basename(c) < name]
    return next((c for c in older[::-1] if not verify_checkpoint(c, options)), None)


def refusal(problem: str, previous: str | None) -> str:
    """Why a checkpoint is refused, and which complete checkpoint to resume instead."""
    if previous is None:
        return f"{problem}; there is no earlier complete checkpoint to resume instead"
    return (
        f"{problem}. The previous complete checkpoint is {previous}: resume it with "
        f"checkpoint.resume_from: {previous}, or set checkpoint.fallback_to_previous: true to "
        "resume the newest complete checkpoint"
    )


def encode_rng(state: torch.Tensor) -> str:
    """A torch RNG state (uint8 tensor) as base64 text for state.json."""
    return base64.b64encode(state.numpy().tobytes()).decode()


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()
