"""model.source as a run reads it, checked early and pinned to exact weights:

- `models:/<name>/<version|latest>` or `@<alias>`: a registered policy (tracking/registry.py),
  pinned to the version it names when the run's policy spec is made;
- an fsspec URL of a Hugging Face model directory (`s3://bucket/models/Qwen3-4B`, gs://,
  file://...): listed (config.json must be there) without downloading, keyed by its listing
  (storage/trees.py), and copied once per content into the task's scratch when the policy is
  prepared. The key is part of the prepared policy's cache key, so a changed upload is never
  served a policy prepared from the old one;
- anything else: a local directory or GGUF (models/pretrained.py), or for a Qwen multimodal kind
  a Hugging Face id that transformers reads.

An s3:// source is read with the run's S3 settings (storage.endpoint_url, the client's retries).
"""

from __future__ import annotations

from typing import Any

from relax_core.config import RunConfig, replace
from relax_core.config.checks import QWEN_MULTIMODAL
from relax_core.config.checks_source import is_url_source
from relax_core.config.services import s3_options
from relax_core.storage import list_tree, tree_copy, tree_key

REQUIRED = "config.json"
"""What a URL must hold to be taken for a Hugging Face model directory."""


def source_options(source: str, storage_options: dict | None) -> dict:
    """fsspec options for reading a URL source: an s3:// one with the run's storage options
    (storage.options(): its endpoint and client settings), others with none."""
    if not source.startswith(("s3://", "s3a://")):
        return {}
    return storage_options or s3_options(source, "")


def listed_source(source: str, options: dict | None) -> dict[str, dict[str, Any]]:
    """The files of the model directory at URL `source`; an error naming model.source and what
    is missing when it cannot be listed or holds no config.json."""
    try:
        files = list_tree(source, options)
    except (OSError, ValueError, ImportError) as exc:
        raise OSError(f"model.source: {exc}") from exc
    if REQUIRED not in files:
        found = f"{len(files)} files, e.g. {', '.join(sorted(files)[:3])}" if files else "nothing"
        copy = f"aws s3 sync <dir> {source}" if source.startswith("s3") else "copy <dir> there"
        raise FileNotFoundError(
            f"model.source: {source} is not a Hugging Face model directory: no {REQUIRED} there "
            f"(found {found}); upload the directory `hf download <id> --local-dir <dir>` "
            f"writes ({copy})"
        )
    return files


def source_problems(cfg: RunConfig) -> list[str]:
    """What keeps the run from reading its model.source (checked before anything starts)."""
    m = cfg.model
    if not m.source or m.kind not in ("pretrained", *QWEN_MULTIMODAL):
        return []
    try:
        if is_url_source(m.source):
            listed_source(m.source, source_options(m.source, cfg.storage.options()))
        elif m.kind == "pretrained" and m.source.startswith("models:"):
            from relax_core.tracking.registry import resolve_model_uri
            from relax_core.tracking.runs import tracking_uri_of

            resolve_model_uri(tracking_uri_of(cfg), m.source)
        elif m.kind == "pretrained":
            from relax_core.models.pretrained import resolve_source

            resolve_source(m.source)
    except (OSError, ValueError, ImportError) as exc:
        text = str(exc)
        return [text if text.startswith("model.source") else f"model.source: {text}"]
    return []


def pin_source(cfg: RunConfig) -> tuple[RunConfig, str, str]:
    """(cfg with a registry source pinned to one version, the registry's tracking URI or "",
    the content key of a URL source or "")."""
    source = cfg.model.source
    if cfg.model.kind == "pretrained" and source.startswith("models:"):
        from relax_core.tracking.registry import resolve_model_uri
        from relax_core.tracking.runs import tracking_uri_of

        uri = tracking_uri_of(cfg)
        pinned = resolve_model_uri(uri, source).uri
        return replace(cfg, model={"source": pinned}), uri, ""
    if cfg.model.kind in ("pretrained", *QWEN_MULTIMODAL) and is_url_source(source):
        options = source_options(source, cfg.storage.options())
        return cfg, "", tree_key(listed_source(source, options))
    return cfg, "", ""


def local_source(
    source: str, key: str, storage_options: dict | None = None, scratch_dir: str = ""
) -> str:
    """A local directory holding the model at URL `source`, copied once per content into
    scratch; `key` (from `pin_source`, "" = any) is the content the policy was keyed on, and a
    source that changed since is refused rather than prepared under the old key."""
    options = source_options(source, storage_options)
    files = listed_source(source, options)
    if key and tree_key(files) != key:
        raise ValueError(
            f"model.source: the files at {source} changed since this run's policy was keyed on "
            f"them (key {key}, now {tree_key(files)}); start the run again to prepare the new "
            "upload"
        )
    return tree_copy(source, files, options, scratch_dir)
