"""model.source checks that need no I/O: a registry reference's form, a URL's scheme and path.

A source is a URL when it has a scheme (`s3://bucket/models/Qwen3-4B`, `gs://...`, `file:///...`,
`memory://...`, chains such as `simplecache::s3://...`), except `models:/` (the registry's). The
run copies a URL source to local disk before loading it (run/sources.py).
"""

from __future__ import annotations

import re

MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(/(?P<version>[0-9]+|latest)|@(?P<alias>[\w-]+))")
"""An MLflow registry reference: models:/<name>/<version>, models:/<name>/latest or
models:/<name>@<alias>."""


def is_url_source(source: str) -> bool:
    """Whether `source` is an fsspec URL of a model directory (not a path, id or registry
    reference)."""
    return "://" in source and not source.startswith("models:")


def source_name(source: str) -> str:
    """The last part of a source's path (`Qwen3-4B` for s3://bucket/models/Qwen3-4B/)."""
    return source.rstrip("/").rsplit("/", 1)[-1]


def source_form_problems(source: str) -> list[str]:
    """What is wrong with the form of a model.source (empty when fine)."""
    if source.startswith("models:"):
        if MODEL_URI.fullmatch(source):
            return []
        return [
            f"model.source: {source!r} is not a registry reference; use models:/<name>/<version>, "
            "models:/<name>/latest or models:/<name>@<alias>"
        ]
    if not is_url_source(source):
        return []
    # Imported here: fsspec doubles the import time of a config without a URL source.
    from fsspec.registry import known_implementations, registry

    schemes, path = source.split("://", 1)
    unknown = [
        s for s in schemes.split("::") if s not in registry and s not in known_implementations
    ]
    if unknown:
        return [
            f"model.source: {source!r} has the scheme {unknown[0]!r}, which fsspec does not know; "
            "use s3://, gs://, file:// or another fsspec URL of the model directory"
        ]
    if not path.strip("/"):
        return [
            f"model.source: {source!r} names no directory; give the model directory's URL, "
            "e.g. s3://my-bucket/models/Qwen3-4B"
        ]
    return []
