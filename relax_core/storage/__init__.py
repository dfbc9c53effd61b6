"""A run's storage: directories published whole under the run's storage root (a local directory
or an fsspec URL such as s3://bucket/prefix), and local copies of them for the task that loads
them.

On a cluster every task is a new pod with an empty disk, so a checkpoint or a prepared policy
one task leaves for another lives here, never at a local path. locations.py joins and tells
local from remote; dirs.py publishes a directory (files first, a commit marker last), lists and
removes published directories, and copies one into local scratch once per content; integrity.py
checks a published directory against the size and sha256 of each file its marker lists;
trees.py lists a directory no run published (a model's weights at a URL) and copies it into
scratch once per listing.

May import: config, queue.
"""

from relax_core.storage.dirs import (
    is_committed,
    is_disk_full,
    local_copy,
    publish_dir,
    read_json,
    remove_dir,
    remove_file,
    write_json,
)
from relax_core.storage.integrity import verify_dir
from relax_core.storage.locations import (
    is_local,
    join,
    local_cache,
    local_dir_for,
    parent,
    scratch_root,
    where,
)
from relax_core.storage.trees import list_tree, tree_copy, tree_key

__all__ = [
    "is_committed",
    "is_disk_full",
    "is_local",
    "join",
    "list_tree",
    "local_dir_for",
    "local_cache",
    "local_copy",
    "parent",
    "publish_dir",
    "read_json",
    "remove_dir",
    "remove_file",
    "scratch_root",
    "tree_copy",
    "tree_key",
    "verify_dir",
    "where",
    "write_json",
]
