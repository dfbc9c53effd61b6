"""What a task hands to the next must not be a place on its own disk.

`local_paths(outputs, storage_root, image_files, config_texts)` lists every string in a task's
outputs that names a local place: an absolute path, a `~` or file:// path, or a relative path with
a '/' that is not a file of the image, and every object-store URL outside the run's storage root.
Strings that are JSON documents (the policy spec, the storage section) are read and their values
checked the same way; the config JSON text itself is exempt (it is the user's input, handed on
as given), and so are URLs of other kinds (http://, models:/, mlflow-artifacts:/).
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from typing import Any

_SCHEME = re.compile(r"^(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*):")
_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2"}
_RELATIVE_PATH = re.compile(r"^\.{0,2}[\w.+@-]*(/[\w.+@-]+)+/?$")


class LocalPathInOutput(AssertionError):
    """A task handed on a place only its own pod could see."""


def _strings(value: Any, where: str, exempt: Collection[str]) -> Iterator[tuple[str, str]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _strings(v, f"{where}.{k}", exempt)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _strings(v, f"{where}[{i}]", exempt)
    elif isinstance(value, str) and value not in exempt:
        text = value.strip()
        if text[:1] in "{[":
            try:
                document = json.loads(text)
            except ValueError:
                document = None
            if isinstance(document, (dict, list)):
                yield from _strings(document, f"{where}<json>", exempt)
                return
        yield where, value


def _problem(
    text: str, storage_root: str, image_files: Collection[str], image_dirs: Collection[str]
) -> str | None:
    """Why `text` names a local place (or a place outside the storage root), else None."""
    if not text or "\n" in text:
        return None
    match = _SCHEME.match(text)
    if match and not re.match(r"^[a-zA-Z]:[\\/]", text):  # not a Windows drive
        scheme = match["scheme"].lower()
        if scheme == "file":
            return "a file:// URL (local to the pod)"
        if scheme in _OBJECT_STORES and not _under(text, storage_root):
            return f"an object-store URL outside the run's storage root {storage_root}"
        return None
    if text.startswith(("/", "~")):
        return "an absolute path (local to the pod)"
    if _RELATIVE_PATH.match(text):
        rel = text.removeprefix("./").rstrip("/")
        if rel in image_files or rel in image_dirs:
            return None  # a file of the image (datasets/..., configs/...): every pod has it
        return "a relative path that is not a file of the image (local to the pod)"
    return None


def _under(url: str, root: str) -> bool:
    root = root.rstrip("/")
    return url == root or url.startswith(root + "/")


def local_paths(
    outputs: dict[str, Any],
    storage_root: str,
    image_files: Collection[str] = (),
    config_texts: Collection[str] = (),
) -> list[str]:
    """One line per offending string: where it is in the outputs, the string and why."""
    files = set(image_files)
    dirs = {"/".join(f.split("/")[:i]) for f in files for i in range(1, f.count("/") + 1)}
    found = []
    for where, text in _strings(outputs, "outputs", set(config_texts)):
        why = _problem(text, storage_root, files, dirs)
        if why:
            found.append(f"{where} = {text!r}: {why}")
    return found


def check_outputs(
    task: str,
    outputs: dict[str, Any],
    storage_root: str,
    image_files: Collection[str] = (),
    config_texts: Collection[str] = (),
) -> None:
    """LocalPathInOutput naming the task and every local place in its outputs."""
    found = local_paths(outputs, storage_root, image_files, config_texts)
    if found:
        raise LocalPathInOutput(
            f"{task} handed on a place no other pod can see (the next task runs on another "
            f"machine; run state belongs under {storage_root}):\n  " + "\n  ".join(found)
        )
