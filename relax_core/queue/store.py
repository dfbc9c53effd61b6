"""A thin object-storage layer over fsspec with the two write modes the commit log needs.

`create_if_absent` is the commit primitive: exactly one of several racing writers wins a path.
On local disk that is a hard link of a fully written, fsynced temp file (link(2) refuses an
existing target atomically, so a reader never sees a partial record). On object stores it is a
conditional put (`If-None-Match: *` on S3), whose failure surfaces as FileExistsError or as an
OSError carrying HTTP 412 depending on the client.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import posixpath
import shutil
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from fsspec.implementations.local import LocalFileSystem

from relax_core.config.filesystems import url_to_fs
from relax_core.queue.errors import StorageError, StorageUnavailable, is_precondition_failed
from relax_core.queue.retry import (
    OUTAGE_NOTICE_S,
    OUTAGES,
    RetryPolicy,
    brief,
    raise_unless_transient,
)

_TMP_PREFIX = ".tmp-"
T = TypeVar("T")


class ObjectStore:
    """Bytes under one root (a local directory or an fsspec URL), addressed by relative paths.

    Every remote call goes through `_call`: transient faults are retried with backoff, and
    setup errors (wrong credentials, missing bucket, unreachable endpoint) become a StorageError
    that names the URL and what to check.
    """

    def __init__(
        self,
        root: str,
        storage_options: dict[str, Any] | None = None,
        durable: bool = True,
        retry: RetryPolicy | None = None,
    ) -> None:
        """`durable=False` skips fsync on local disk: writes still survive a crash of the
        process (the page cache outlives it) but not of the machine."""
        if not root:
            raise ValueError("storage root is empty; give a directory or a URL such as s3://b/p")
        self.fs, self.root = url_to_fs(root, **(storage_options or {}))
        self.root = self.root.rstrip("/") or "/"
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.durable = durable
        self.retry = retry or RetryPolicy()
        self.retries_used = 0
        self._made_dirs: set[str] = set()
        self._root_url: str | None = None

    def full_path(self, path: str) -> str:
        """The filesystem path of `path` (relative to the root), for error messages and fsspec."""
        return posixpath.join(self.root, path)

    def url(self, path: str) -> str:
        """`path` as a URL a person can paste (protocol included for remote stores)."""
        if self._root_url is None:
            self._root_url = self.fs.unstrip_protocol(self.root).rstrip("/")
        return f"{self._root_url}/{path}" if path else self._root_url

    def _call(self, what: str, path: str, fn: Callable[[], T], attempts: int | None = None) -> T:
        """Run `fn` with quick retries on transient faults, then, while the store stays
        unreachable, keep trying until the outage limit; classify what finally fails."""
        attempts = attempts or self.retry.attempts
        first_failure = 0.0
        waiting = False
        try:
            for attempt in itertools.count():
                try:
                    result = fn()
                except Exception as err:
                    raise_unless_transient(err, what, self.url(path))
                    now = time.monotonic()
                    first_failure = first_failure or now
                    down, limit = now - first_failure, self.retry.limit_s()
                    quick = attempt + 1 < attempts
                    if not quick and down >= limit:
                        raise self._unavailable(what, path, attempt + 1, down, err) from err
                    if not quick or down >= OUTAGE_NOTICE_S:  # no blip: an outage, said so
                        if not waiting:
                            OUTAGES.join(self._root_key())
                            waiting = True
                        OUTAGES.waiting(self._root_key(), first_failure, what, limit, err)
                    self.retries_used += 1
                    if quick:
                        time.sleep(self.retry.delay(attempt))
                    else:
                        time.sleep(min(self.retry.outage_poll_s, max(limit - down, 0.0)))
                    continue
                if waiting:
                    OUTAGES.leave(self._root_key(), recovered=True)
                    waiting = False
                return result
        finally:
            if waiting:
                OUTAGES.leave(self._root_key(), recovered=False)
        raise AssertionError("unreachable")

    def _root_key(self) -> str:
        return self.url("")

    def _unavailable(
        self, what: str, path: str, tries: int, down_s: float, err: Exception
    ) -> StorageUnavailable:
        limit = self.retry.limit_s()
        waited = (
            f"unreachable for {down_s:.1f} s, past storage.outage_limit_s = {limit:g} s,"
            if limit > 0
            else f"failed {tries} times"
        )
        return StorageUnavailable(
            f"storage at {self.url(path)} {waited} {what} ({brief(err)}); "
            "check that the endpoint is reachable"
        )

    def check_access(self, path: str = "") -> None:
        """Write, read back and delete a probe object; a StorageError says what is wrong."""
        path = path or f"control/probe/access-{uuid.uuid4().hex}"
        self.write_replace(path, b"probe")
        if self.read_bytes(path) != b"probe":
            raise StorageError(f"storage at {self.url(path)} returned other bytes than written")
        self.delete(path)

    def create_if_absent(self, path: str, data: bytes) -> bool:
        """Write `data` at `path` only if nothing is there; True if this call created it."""
        full = self.full_path(path)
        if self.is_local:
            return self._local_create_if_absent(full, data)
        tries = 0

        def create() -> bool:
            nonlocal tries
            tries += 1
            try:
                with self.fs.open(full, "xb") as f:
                    f.write(data)
                return True
            except Exception as err:
                if not is_precondition_failed(err):
                    raise  # _call retries transient faults and classifies the rest
                if tries == 1:
                    return False
                # An earlier try may have been applied with its reply lost: the object is ours
                # exactly when it holds our bytes (records carry a unique nonce).
                return self.read_bytes(path) == data

        return self._call("creating", path, create)

    def write_immutable(self, path: str, data: bytes) -> None:
        """Write a payload that is never rewritten; readers see all of it or nothing."""
        full = self.full_path(path)
        if self.is_local:
            tmp = self._local_write_tmp(full, data)
            os.replace(tmp, full)
            self._fsync_dir(posixpath.dirname(full))
        else:
            self._call("writing", path, lambda: self.fs.pipe_file(full, data))

    def write_replace(self, path: str, data: bytes) -> None:
        """Write or overwrite `path` atomically (for small status objects such as heartbeats)."""
        full = self.full_path(path)
        if self.is_local:
            os.replace(self._local_write_tmp(full, data, fsync=False), full)
        else:
            self._call("writing", path, lambda: self.fs.pipe_file(full, data))

    def read_bytes(self, path: str) -> bytes:
        """All bytes at `path`; FileNotFoundError naming the path if it is absent."""
        full = self.full_path(path)
        try:
            if self.is_local:
                with open(full, "rb") as f:
                    return f.read()
            return self._call("reading", path, lambda: self.fs.cat_file(full))
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no object at {self.url(path)}") from err

    def read_many(self, paths: list[str], max_bytes: int = 0) -> dict[str, bytes]:
        """path -> bytes (the first `max_bytes` if > 0) for the paths that exist; remote reads
        go out concurrently."""
        if self.is_local:
            out = {}
            for path in paths:
                with contextlib.suppress(FileNotFoundError), open(self.full_path(path), "rb") as f:
                    out[path] = f.read(max_bytes) if max_bytes > 0 else f.read()
            return out
        if not paths:
            return {}
        full = {self.full_path(p): p for p in paths}

        def cat() -> dict:
            if max_bytes > 0:
                starts, ends = [0] * len(full), [max_bytes] * len(full)
                parts = self.fs.cat_ranges(list(full), starts, ends, on_error="return")
                got = dict(zip(full, parts, strict=True))
            else:
                got = self.fs.cat(list(full), on_error="return")
            # Only an absent object is absent: a read that failed (the store restarting) must
            # not pass for one, or a listing of checkpoints or entries would silently shrink.
            for value in got.values():
                if isinstance(value, Exception) and not isinstance(value, FileNotFoundError):
                    raise value
            return got

        got = self._call("reading", paths[0], cat)
        return {full[k]: v for k, v in got.items() if k in full and isinstance(v, bytes)}

    def list_dir(self, prefix: str) -> list[str]:
        """Sorted names directly under `prefix` (not paths); [] if it is absent or an object.

        Listings are never served from fsspec's cache: a stale listing would hide commits.
        """
        full = self.full_path(prefix)
        if self.is_local:
            try:
                names = os.listdir(full)
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted(n for n in names if not n.startswith(_TMP_PREFIX))

        def ls() -> list[str]:
            self.fs.invalidate_cache(full)
            try:
                return self.fs.ls(full, detail=False)
            except FileNotFoundError:
                return []

        names = (posixpath.basename(e.rstrip("/")) for e in self._call("listing", prefix, ls))
        return sorted(n for n in names if n and not n.startswith(_TMP_PREFIX))

    def exists(self, path: str) -> bool:
        full = self.full_path(path)
        if self.is_local:
            return os.path.exists(full)

        def exists() -> bool:
            self.fs.invalidate_cache(posixpath.dirname(full))
            return self.fs.exists(full)

        return self._call("checking", path, exists)

    def delete(self, path: str) -> None:
        """Remove `path` if present (probe objects and payloads moved to quarantine)."""

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self.full_path(path))

        self._call("deleting", path, rm)

    def delete_many(self, paths: list[str]) -> None:
        """Remove those of `paths` that are present; on S3 one request per 1,000 objects (the
        queue's retention deletes thousands of entries per checkpoint)."""
        if self.is_local:
            for path in paths:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.full_path(path))
            return
        full = [self.full_path(p) for p in paths]

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):  # none of them was there
                self.fs.rm(full)

        if full:
            self._call("deleting", paths[0], rm)

    def put_file(self, local: str, path: str) -> None:
        """Upload a local file to `path`, streamed in chunks (multipart on S3), so a model
        file is never held in memory whole."""
        full = self.full_path(path)
        if self.is_local:
            self._ensure_dir(posixpath.dirname(full))
        self._call("uploading", path, lambda: self.fs.put_file(local, full))

    def get_file(self, path: str, local: str) -> None:
        """Download `path` to a local file, streamed in chunks."""
        full = self.full_path(path)
        try:
            self._call("downloading", path, lambda: self.fs.get_file(full, local))
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no object at {self.url(path)}") from err

    def walk_files(self, prefix: str) -> list[str]:
        """Every file under `prefix`, as paths relative to it, sorted (uncached listing)."""
        full = self.full_path(prefix).rstrip("/")

        def find() -> list[str]:
            if not self.is_local:
                self.fs.invalidate_cache(full)
            try:
                found = self.fs.find(full, detail=True)
            except FileNotFoundError:
                return []
            # Some S3 servers (SeaweedFS) answer with the folder itself among the files.
            files = (p for p, info in found.items() if info.get("type") != "directory")
            return [r for r in (posixpath.relpath(p, full) for p in files) if r != "."]

        return sorted(self._call("listing", prefix, find))

    def delete_tree(self, prefix: str) -> None:
        """Remove everything under `prefix` (the folder itself too, where the server keeps
        folders)."""
        full = self.full_path(prefix).rstrip("/")
        if self.is_local:
            shutil.rmtree(full, ignore_errors=True)
            return

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(full, recursive=True)
            self.fs.invalidate_cache(full)

        self._call("deleting", prefix, rm)

    def _ensure_dir(self, directory: str) -> None:
        if directory not in self._made_dirs:
            os.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)

    def _local_write_tmp(self, full: str, data: bytes, fsync: bool = True) -> str:
        directory, name = posixpath.split(full)
        self._ensure_dir(directory)
        tmp = posixpath.join(directory, f"{_TMP_PREFIX}{name}-{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileNotFoundError:  # the directory was removed since we made it (a pruned version)
            self._made_dirs.discard(directory)
            self._ensure_dir(directory)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync and self.durable:
                os.fsync(fd)
        except BaseException as err:
            os.close(fd)
            os.unlink(tmp)
            if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OSError(
                    err.errno,
                    f"no space left on device writing {full} (nothing of it was kept): free "
                    "space on that disk, or move the run's storage (queue.root, storage.root) "
                    "elsewhere, and resume with checkpoint.resume: true",
                ) from err
            raise
        os.close(fd)
        return tmp

    def _local_create_if_absent(self, full: str, data: bytes) -> bool:
        tmp = self._local_write_tmp(full, data)
        try:
            os.link(tmp, full)
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        self._fsync_dir(posixpath.dirname(full))
        return True

    def _fsync_dir(self, directory: str) -> None:
        # A new directory entry is only durable once the directory itself is fsynced.
        if not self.durable:
            return
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def probe_create_if_absent(store: ObjectStore, path: str) -> bool:
    """Whether `store` refuses a second create of the same path (False: the condition is ignored).

    Storage that ignores the condition would let two writers overwrite one commit record, so
    multi-writer commits must not run on it.
    """
    try:
        first = store.create_if_absent(path, b"probe-1")
        second = store.create_if_absent(path, b"probe-2")
    finally:
        store.delete(path)
    return first and not second
