"""A directory of files at any fsspec URL (a model's weights on S3, GCS, a file:// path) that no
run published, and a local copy of it made once per content.

Nothing marks such a directory complete or records its hashes, so its copy is keyed by its
listing: each file's relative path, size and version, the version being the store's content hash
where its listing has one (S3's ETag, GCS's md5Hash or crc32c) and else the file's modification
time. The same files are downloaded once per machine; a changed upload lists differently and gets
a copy of its own. Files are streamed to disk, each size checked, into a staging directory
renamed into place when complete (dirs.fill_once): a download that fails or is killed leaves
nothing that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import re
from typing import Any

from relax_core.queue.retry import brief
from relax_core.queue.store import ObjectStore
from relax_core.storage.dirs import download_files, fill_once
from relax_core.storage.locations import scratch_root

VERSION_FIELDS = (
    "ETag",
    "etag",
    "md5Hash",
    "crc32c",
    "content_md5",
    "checksum",
    "sha256",
    "mtime",
    "LastModified",
    "last_modified",
    "updated",
    "created",
)
"""Listing fields that tell one version of a file from another, best first: content hashes
(s3fs, gcsfs, adlfs...), then modification times (the local filesystem, memory://)."""


def list_tree(url: str, options: dict | None = None) -> dict[str, dict[str, Any]]:
    """relative path -> {size, version} of every file under `url` (empty when nothing is
    there); OSError naming the URL when the store cannot be listed (unreachable, no access)."""
    try:
        store = ObjectStore(url, options)  # some clients connect here (ftp, sftp)
        root = store.full_path("").rstrip("/")
        if not store.is_local:
            store.fs.invalidate_cache(root)
        found = store.fs.find(root, detail=True)
    except FileNotFoundError:
        found = {}
    except Exception as exc:  # noqa: BLE001 - each client has its own errors; all mean the same
        raise OSError(
            f"cannot list {url} ({brief(exc)}): check that the store is reachable and that its "
            "credentials may read it (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, "
            "storage.endpoint_url)"
        ) from exc
    files = {}
    for path, info in found.items():
        name = posixpath.relpath(path, root)
        # Some S3 servers (SeaweedFS) answer with folders among the files.
        if info.get("type") == "directory" or name == "." or name.startswith("../"):
            continue
        version = next((info[k] for k in VERSION_FIELDS if info.get(k) is not None), "")
        files[name] = {"size": info.get("size"), "version": str(version)}
    return files


def tree_key(files: dict[str, dict[str, Any]]) -> str:
    """24 hex digits naming a listing's content: equal listings, equal keys."""
    rows = sorted([name, f["size"], f["version"]] for name, f in files.items())
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:24]


def tree_copy(
    url: str, files: dict[str, dict[str, Any]], options: dict | None = None, scratch_dir: str = ""
) -> str:
    """A local directory holding `files` (what `list_tree(url)` found), downloaded into scratch
    under `<last part of url>-<tree_key>` unless a copy of the same listing is there already."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", url.rstrip("/").rsplit("/", 1)[-1]) or "tree"
    target = os.path.join(scratch_root(scratch_dir), "trees", f"{name}-{tree_key(files)}")
    store = ObjectStore(url, options)
    sizes = {n: {"size": f["size"]} for n, f in files.items()}
    return fill_once(target, lambda staging: download_files(store, sizes, staging))
