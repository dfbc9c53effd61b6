"""fsspec filesystems for a run's URLs, each protocol served by fsspec's own implementation.

fsspec keeps one process-wide table from protocol to filesystem class, and a library may replace
an entry: importing Flyte 2 (`flyte`, the flyte2 extra) registers obstore's stores for s3, gs,
abfs and the rest with clobber=True (flyte.storage calls obstore.fsspec.register). Those take
other options than s3fs, gcsfs and adlfs (no `key`, `secret`, `client_kwargs`, `config_kwargs`)
and no "xb" mode, so a run's storage options would fail in any process that imported it. Every
URL a run opens therefore goes through `url_to_fs`, which takes the class fsspec itself names for
the protocol (fsspec.registry.known_implementations), whatever was registered since; a protocol
fsspec does not know is looked up in the table as before.
"""

from __future__ import annotations

import importlib
from typing import Any

import fsspec
from fsspec.core import split_protocol


def filesystem_class(protocol: str) -> type:
    """The filesystem class fsspec ships for `protocol` (its known implementation)."""
    from fsspec.registry import known_implementations

    spec = known_implementations.get(protocol)
    if spec is None:
        return fsspec.get_filesystem_class(protocol)
    module, _, name = spec["class"].rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise ImportError(spec.get("err") or f"{protocol}:// needs {module}: {err}") from err


def url_to_fs(url: str, **options: Any) -> tuple[Any, str]:
    """(filesystem, path) for `url`, as fsspec.core.url_to_fs gives them, with the protocol's
    own implementation. Local paths and chained URLs (`a::b://`) are fsspec's as they are."""
    protocol = split_protocol(url)[0]
    if protocol in (None, "file", "local") or "::" in url:
        return fsspec.core.url_to_fs(url, **options)
    cls = filesystem_class(protocol)
    kwargs = {**cls._get_kwargs_from_urls(url), **options}
    return cls(**kwargs), cls._strip_protocol(url)


def open_url(url: str, mode: str = "rb", **options: Any):
    """`url` opened as fsspec.open(url, mode, **options) would, with url_to_fs's filesystem
    (a text mode takes `encoding`)."""
    encoding = options.pop("encoding", None)
    fs, path = url_to_fs(url, **options)
    if "b" in mode:
        return fs.open(path, mode)
    return fs.open(path, mode, encoding=encoding)
