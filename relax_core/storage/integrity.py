"""Whether a published directory is what its marker says: the manifest a marker carries (each
file's size and sha256) and the check of a directory, or of one downloaded file, against it.

Sizes are checked before any hash: a truncated or missing file is found without reading the
others. sha256 runs at about 1.4 GB/s here (0.39 s for a 540 MB checkpoint, a third of what
writing it takes), so a whole directory is hashed rather than sampled: a size check alone misses
bytes changed in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
from typing import Any

from relax_core.queue.store import ObjectStore
from relax_core.storage.locations import is_local, where

_HASH_CHUNK = 8 << 20


def manifest(directory: str, sync: bool = False) -> dict[str, dict[str, Any]]:
    """relative path -> {size, sha256} of every file under `directory` (each fsynced if `sync`)."""
    out = {}
    for base, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(base, name)
            rel = os.path.relpath(path, directory).replace(os.sep, "/")
            out[rel] = {"size": os.path.getsize(path), "sha256": sha256_of(path, sync)}
    return out


def sha256_of(path: str, sync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
        if sync:
            os.fsync(f.fileno())
    return digest.hexdigest()


def verify_dir(location: str, marker: str, options: dict | None = None) -> str:
    """What is wrong with the published directory at `location`, "" when it is whole: its marker
    is there and every file the marker lists is there with its size and (on local disk) its
    sha256. On an object store sizes are checked here and hashes by `local_copy` as it
    downloads. A marker that lists no files (written before markers did) is taken as it is."""
    if is_local(location):
        return _verify_local(where(location), marker)
    store = ObjectStore(location, options)
    try:
        raw = store.read_bytes(marker)
    except FileNotFoundError:
        return _missing_marker(store.url(marker), marker)
    files, problem = _listed(store.url(marker), raw)
    if problem or not files:
        return problem
    root = store.full_path("").rstrip("/")
    store.fs.invalidate_cache(root)
    found = store.fs.find(root, detail=True)
    sizes = {posixpath.relpath(p, root): info.get("size") for p, info in found.items()}
    for name, want in sorted(files.items()):
        problem = _size_problem(store.url(name), want.get("size"), sizes.get(name), marker)
        if problem:
            return problem
    return ""


def _verify_local(path: str, marker: str) -> str:
    if not os.path.isdir(path):
        return f"{path} does not exist"
    marker_path = os.path.join(path, marker)
    try:
        with open(marker_path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return _missing_marker(marker_path, marker)
    files, problem = _listed(marker_path, raw)
    if problem:
        return problem
    sizes = {}
    for name in files:
        with contextlib.suppress(FileNotFoundError):
            sizes[name] = os.path.getsize(os.path.join(path, name))
    for name, want in sorted(files.items()):  # every cheap check before any hash
        problem = _size_problem(os.path.join(path, name), want.get("size"), sizes.get(name), marker)
        if problem:
            return problem
    for name, want in sorted(files.items()):
        file = os.path.join(path, name)
        if want.get("sha256") and sha256_of(file) != want["sha256"]:
            return (
                f"{file}: its content differs from the sha256 {marker} records (the right size, "
                "other bytes: changed or corrupted on disk)"
            )
    return ""


def _missing_marker(marker_path: str, marker: str) -> str:
    return (
        f"{marker_path} is missing: the directory was never completely written (a crash or a "
        f"full disk), or its {marker} was deleted"
    )


def _listed(marker_path: str, raw: bytes) -> tuple[dict[str, dict[str, Any]], str]:
    """(the files a marker lists, "") or ({}, what is wrong with the marker)."""
    try:
        document = json.loads(raw)
    except ValueError as exc:
        return {}, f"{marker_path} is not valid JSON ({exc})"
    if not isinstance(document, dict):
        return {}, f"{marker_path} is not a JSON object"
    return document.get("files") or {}, ""


def _size_problem(file: str, expected: int | None, found: int | None, marker: str) -> str:
    if found is None:
        return f"{file} is missing ({marker} lists it with {expected} bytes)"
    if expected is not None and found != expected:
        return f"{file}: expected {expected} bytes ({marker} says so), found {found} (truncated?)"
    return ""


def file_problem(local: str, want: dict[str, Any]) -> str:
    """What differs between a local file (a download) and its marker entry, "" if nothing."""
    size = os.path.getsize(local)
    if want.get("size") is not None and size != want["size"]:
        return f"downloaded {size} bytes, the marker says {want['size']} (truncated or changed)"
    if want.get("sha256") and sha256_of(local) != want["sha256"]:
        return "downloaded content differs from its sha256 in the marker (corrupted or changed)"
    return ""
