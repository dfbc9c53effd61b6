"""Directories published whole under a run's storage root, and local copies of them.

A published directory (a checkpoint, a prepared policy) is "whole or not at all":
- on local disk it is built in a staging sibling, its files fsynced, and renamed into place
  (rename is atomic); a write that fails (a full disk) removes the staging directory;
- on an object store, where there is no rename, its files are uploaded first and its commit
  marker last.
The marker is JSON the caller chooses (a checkpoint's state.json) plus `files`, each file's size
and sha256. A directory without its marker is not there for readers; `verify_dir` says what is
wrong with one whose files no longer match their marker (truncated, deleted, changed).

`local_copy` gives a task a local directory to load from: a local place as it is, a remote one
downloaded once into scratch under a key derived from its marker (so from the files' hashes),
each file streamed to disk rather than held in memory. Two processes of one machine asking for
the same copy share it.

A writer killed outright (SIGKILL, the OOM killer, a node lost) cleans nothing up: its staging
directory stays, as large as what it was writing (a checkpoint's weights and optimizer state).
Each publish and copy therefore first removes the staging leftovers beside its own (`.tmp-*`
next to a local target, `.publish-*` in scratch, `*.tmp-*` among the copies) that nothing has
written for STALE_STAGING_S, logging each; a live writer's files are younger than that.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import hashlib
import json
import logging
import os
import shutil
import time
import traceback
import uuid
from collections.abc import Callable
from typing import Any

from relax_core.queue.store import ObjectStore
from relax_core.storage.integrity import file_problem, manifest
from relax_core.storage.locations import is_local, join, scratch_root, where

log = logging.getLogger(__name__)

STALE_STAGING_S = 6 * 3600.0
"""How long a staging leftover goes unwritten before a publish or copy beside it removes it: a
writer that lives keeps writing its files (each write moves their mtime), so only a dead one's
go this long untouched."""


def sweep_stale_staging(
    directory: str, pattern: str, older_than_s: float = STALE_STAGING_S
) -> list[str]:
    """Remove the entries of `directory` whose names match `pattern` (fnmatch) and in which
    nothing was written for `older_than_s`: what killed writers left. Returns their paths.
    Best effort: an entry another process removes meanwhile, or one that cannot be removed, is
    passed over."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    cutoff, removed = time.time() - older_than_s, []
    for name in names:
        if not fnmatch.fnmatchcase(name, pattern):
            continue
        path = os.path.join(directory, name)
        last = _last_written(path)
        if last is None or last > cutoff:
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if not os.path.lexists(path):
            removed.append(path)
            log.warning(
                "removed %s: a staging leftover nothing wrote for %.1f h (a writer killed "
                "before it could clean up)",
                path,
                (time.time() - last) / 3600,
            )
    return removed


def _last_written(path: str) -> float | None:
    """The newest mtime of `path` and everything under it; None when it is gone."""
    try:
        newest = os.lstat(path).st_mtime
    except OSError:
        return None
    if os.path.isdir(path) and not os.path.islink(path):
        for root, dirs, files in os.walk(path):
            for name in dirs + files:
                with contextlib.suppress(OSError):
                    newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _store(location: str, options: dict | None) -> ObjectStore:
    return ObjectStore(location, options)


def is_committed(location: str, marker: str, options: dict | None = None) -> bool:
    """Whether a whole directory is published at `location` (its marker is there)."""
    if is_local(location):
        return os.path.isfile(join(where(location), marker))
    return _store(location, options).exists(marker)


def read_json(location: str, options: dict | None = None) -> Any:
    """The JSON document at a file location (local path or URL)."""
    if is_local(location):
        with open(location) as f:
            return json.load(f)
    store = _store(location.rsplit("/", 1)[0], options)
    return json.loads(store.read_bytes(location.rsplit("/", 1)[1]))


def write_json(location: str, value: Any, options: dict | None = None) -> None:
    """Write (or replace) a small JSON document at a file location, whole or not at all."""
    data = json.dumps(value, indent=1, sort_keys=True).encode()
    if is_local(location):
        directory = os.path.dirname(os.path.abspath(location))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, location)
        return
    parent_url, name = location.rsplit("/", 1)
    _store(parent_url, options).write_replace(name, data)


def publish_dir(
    location: str,
    marker: str,
    build: Callable[[str], dict[str, Any]],
    options: dict | None = None,
    scratch_dir: str = "",
) -> str:
    """Build a directory with `build(staging_dir) -> marker document` and publish it whole at
    `location` (replacing what is there). Returns the location as handed to other tasks."""
    if is_local(location):
        return _publish_local(where(location), marker, build)
    scratch = scratch_root(scratch_dir)
    sweep_stale_staging(scratch, ".publish-*")
    staging = os.path.join(scratch, f".publish-{uuid.uuid4().hex}")
    os.makedirs(staging)
    built = False
    try:
        document = dict(build(staging))
        files = manifest(staging)
        built = True
        files.pop(marker, None)
        document["files"] = files
        store = _store(location, options)
        store.delete(marker)  # a directory being replaced is not there until its new marker is
        store.delete_many([n for n in store.walk_files("") if n not in files])
        for name in sorted(files):
            store.put_file(os.path.join(staging, name), name)
        store.write_replace(marker, json.dumps(document, indent=1, sort_keys=True).encode())
    except BaseException as exc:
        error = exc if built else _unwritten(exc, f"{location} (staged in {staging})", staging)
        if error is exc:
            raise
        raise error from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return where(location)


def _publish_local(final: str, marker: str, build: Callable[[str], dict[str, Any]]) -> str:
    parent_dir = os.path.dirname(final)
    os.makedirs(parent_dir, exist_ok=True)
    sweep_stale_staging(parent_dir, ".tmp-*")
    staging = os.path.join(parent_dir, f".tmp-{uuid.uuid4().hex}")
    os.makedirs(staging)
    try:
        document = dict(build(staging))
        # fsynced before the marker: after a power loss a marker never names a file whose
        # bytes did not reach the disk (zero-length files behind a complete-looking marker).
        document["files"] = manifest(staging, sync=True)
        document["files"].pop(marker, None)
        with open(os.path.join(staging, marker), "w") as f:
            json.dump(document, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same directory published again (a resumed run)
            shutil.rmtree(final)
        os.rename(staging, final)
        _fsync_dir(parent_dir)
    except BaseException as exc:
        error = _unwritten(exc, final, staging)
        shutil.rmtree(staging, ignore_errors=True)
        if error is exc:
            raise
        raise error from exc
    return final


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FULL_BYTES = 1 << 20
"""Free space below which a failed write is taken for a full disk (a root process fails only
once the reserved blocks are gone too, with f_bavail long at 0)."""


def is_disk_full(err: BaseException, directory: str = "") -> bool:
    """Whether `err` (or what caused it) is a full disk or an exhausted quota; with `directory`,
    also whether its filesystem has (almost) no space left. torch.save reports a full disk as
    "unexpected pos" with the errno lost (pytorch/pytorch#10577), so the error alone cannot
    tell."""
    seen: set[int] = set()
    cur: BaseException | None = err
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        # Native writers (safetensors' Rust) raise their own error type with the OS's text.
        if "No space left on device" in str(cur) or "Disk quota exceeded" in str(cur):
            return True
        cur = cur.__cause__ or cur.__context__
    if directory:
        with contextlib.suppress(OSError):
            st = os.statvfs(directory)
            return st.f_bavail * st.f_frsize < _FULL_BYTES
    return False


def _unwritten(exc: BaseException, place: str, staging: str) -> BaseException:
    """What to raise for a failed publish: a full disk as OSError(ENOSPC) naming the place
    (asked while the staging directory still fills it), anything else as it is."""
    if not (isinstance(exc, Exception) and is_disk_full(exc, staging)):
        return exc
    # A writer that failed mid-file (torch.save's) stays alive in the traceback's frames with
    # its file open: deleting the staging directory would free none of its space until the
    # error is collected. Its locals go; the traceback's lines stay.
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        traceback.clear_frames(cur.__traceback__)
        cur = cur.__cause__ or cur.__context__
    text = f"no space left on device writing {place} ({type(exc).__name__}: {exc})"
    return OSError(errno.ENOSPC, text)


def remove_dir(location: str, marker: str, options: dict | None = None) -> None:
    """Unpublish, then delete, a directory: its marker goes first, so a reader never takes a
    half-deleted directory for a whole one."""
    if is_local(location):
        path = where(location)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, marker))
        shutil.rmtree(path, ignore_errors=True)
        return
    store = _store(location, options)
    store.delete(marker)
    store.delete_tree("")


def local_copy(
    location: str,
    marker: str,
    options: dict | None = None,
    scratch_dir: str = "",
    exclude: tuple[str, ...] = (),
) -> str:
    """A local directory holding the published directory at `location` (without the files or
    folders named in `exclude`, which a task that does not need them never downloads)."""
    if is_local(location):
        path = where(location)
        if not os.path.isfile(os.path.join(path, marker)):
            raise FileNotFoundError(f"{path} is not a published directory (no {marker})")
        return path
    store = _store(location, options)
    try:
        raw = store.read_bytes(marker)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{location} is not a published directory (no {marker}): it was never committed, "
            "or it was pruned"
        ) from None
    files = json.loads(raw).get("files") or {n: {} for n in store.walk_files("") if n != marker}
    wanted = sorted(n for n in files if not _excluded(n, exclude))
    key = hashlib.sha256(raw + json.dumps(sorted(exclude)).encode()).hexdigest()[:24]

    def fill(staging: str) -> None:
        download_files(store, {n: files[n] for n in wanted}, staging)
        with open(os.path.join(staging, marker), "wb") as f:
            f.write(raw)

    return fill_once(os.path.join(scratch_root(scratch_dir), "copies", key), fill, marker)


def fill_once(target: str, fill: Callable[[str], None], done: str = "") -> str:
    """`target`, a local directory that `fill(staging)` writes once: into a staging sibling
    renamed into place whole, so a directory at `target` (holding `done`, when given) is complete
    and a fill that fails or is killed leaves nothing there. An existing one is returned as is;
    two processes of one machine filling the same target end up sharing one of theirs."""
    if os.path.exists(os.path.join(target, done)):
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    sweep_stale_staging(os.path.dirname(target), "*.tmp-*")
    tmp = f"{target}.tmp-{uuid.uuid4().hex}"
    os.makedirs(tmp)
    try:
        fill(tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process of this machine made the same copy first
            if not os.path.exists(os.path.join(target, done)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def download_files(store: ObjectStore, files: dict[str, dict[str, Any]], directory: str) -> None:
    """Download `files` (relative path -> its expected size and sha256, either optional) from
    `store` into `directory`, each streamed to disk and checked as it lands."""
    for name in sorted(files):
        local = os.path.join(directory, name)
        os.makedirs(os.path.dirname(local), exist_ok=True)
        store.get_file(name, local)
        problem = file_problem(local, files[name])
        if problem:
            raise OSError(f"{store.url(name)}: {problem}")


def _excluded(name: str, exclude: tuple[str, ...]) -> bool:
    return any(name == e or name.startswith(f"{e}/") for e in exclude)


def remove_file(location: str, options: dict | None = None) -> None:
    """Delete one file (local path or URL) if it is there."""
    if is_local(location):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(location)
        return
    parent_url, name = location.rsplit("/", 1)
    _store(parent_url, options).delete(name)
