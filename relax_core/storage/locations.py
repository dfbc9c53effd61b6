"""Places in a run's storage, written as local paths or URLs (`s3://bucket/prefix/...`).

A local place is kept absolute once it leaves the task that made it; a URL is kept as given.
"""

from __future__ import annotations

import os
import posixpath
import tempfile


def is_local(location: str) -> bool:
    """True for a filesystem path (or file:// URL), False for any other fsspec URL."""
    return "://" not in location or location.startswith("file://")


def where(location: str) -> str:
    """`location` as it is handed to another task: absolute if local, unchanged if a URL."""
    if location.startswith("file://"):
        location = location[len("file://") :]
    return os.path.abspath(location) if is_local(location) else location.rstrip("/")


def join(location: str, *parts: str) -> str:
    if is_local(location):
        return os.path.join(location, *parts)
    return posixpath.join(location.rstrip("/"), *parts)


def parent(location: str) -> str:
    """The place that holds `location` (a checkpoint's run directory)."""
    if is_local(location):
        return os.path.dirname(os.path.abspath(location))
    return posixpath.dirname(location.rstrip("/"))


def scratch_root(scratch_dir: str = "") -> str:
    """The task's local scratch: `scratch_dir`, else $TMPDIR/relax-scratch (a pod's own disk)."""
    return os.path.abspath(scratch_dir or os.path.join(tempfile.gettempdir(), "relax-scratch"))


def local_dir_for(location: str, scratch_dir: str = "") -> str:
    """A local directory standing for `location`: itself if local, else a folder in scratch
    named after the URL. For what stays on the task's own disk (logs, caches of downloads)."""
    if is_local(location):
        return where(location)
    bare = location.split("://", 1)[1].strip("/")
    return os.path.join(scratch_root(scratch_dir), "local", *bare.split("/"))


def local_cache(cfg, name: str) -> str:
    """`name` (hf, registry) in the prepared-policy cache when that is local, else in scratch:
    downloads and conversions a task makes for itself stay on its own disk."""
    return os.path.join(
        local_dir_for(cfg.checkpoint.policy_cache_dir, cfg.storage.scratch_dir), name
    )
