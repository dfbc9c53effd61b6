"""The Flyte types of the dataclasses in task interfaces, built once per process and kept on
disk between processes.

flytekit's dataclass transformer builds a dataclass's literal type (its fields' types and the
JSON schema the Flyte console draws the input form from) again for every task and workflow
interface that names it, and for every nested section inside it. For `RunConfig` that is a whole
schema tree per interface (0.6-0.8 s each on 2 idle CPU cores), paid by every `pyflyte run` and
every pod that loads the workflow module before its task starts; for the small summaries the
tasks return (`RunSummary`, `EvalSummary`) the build is quick, but its first one imports
mashumaro's JSON-schema builder (0.25-0.33 s). This transformer is flytekit's own, with the
literal type of each registered dataclass kept after the first build: the same type, schema
and values. When every dataclass of the loaded interfaces comes from the cache, the builder is
never imported.

Across processes the built type is kept in relax's cache directory (`$RELAX_CACHE_DIR`, else
`$XDG_CACHE_HOME/relax`, else `~/.cache/relax`; under `flyte-types/`), under a key of
everything that shapes it: the source of the config modules and of the module defining the type,
and the flytekit, mashumaro and Python versions. A changed config or summary is a new key, so it
is built again; a cache that cannot be read or written only costs the build.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

from flyteidl.core import types_pb2
from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.types import LiteralType

import relax_core.config
from relax_core.config import RunConfig


def cache_dir() -> Path:
    own = os.environ.get("RELAX_CACHE_DIR")
    if own:
        return Path(own) / "flyte-types"
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "relax" / "flyte-types"


def source_of(t: type) -> str | None:
    """The source file defining `t` (None without one, as in a bytecode-only install)."""
    return inspect.getsourcefile(t)


def type_key(t: type) -> str:
    """What `t`'s literal type depends on: the source of the config modules and of the module
    defining `t`, and the libraries that build it (a digest)."""
    digest = hashlib.sha256()
    libraries = (sys.version, version("flytekit"), version("mashumaro"))
    for part in (t.__module__, t.__qualname__, *libraries):
        digest.update(part.encode() + b"\0")
    sources = set(Path(relax_core.config.__file__).parent.glob("*.py"))
    sources.add(Path(source_of(t)))
    for path in sorted(sources):
        name = f"{path.parent.name}/{path.name}"
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{t.__qualname__}-{digest.hexdigest()[:24]}"


def read_cached(path: Path) -> LiteralType | None:
    try:
        pb = types_pb2.LiteralType()
        pb.ParseFromString(path.read_bytes())
        return LiteralType.from_flyte_idl(pb)
    except Exception:  # noqa: BLE001 - missing, unreadable or not a type: build it instead
        return None


def write_cached(path: Path, literal_type: LiteralType) -> None:
    """Write `literal_type` whole or not at all (a renamed temporary file); failures are ignored."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(literal_type.to_flyte_idl().SerializeToString())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


class OnceDataclassTransformer(DataclassTransformer):
    """flytekit's dataclass transformer with each type's literal type built once: per process,
    and across processes through the cache directory for the types in `disk_cached`."""

    def __init__(self, disk_cached: tuple[type, ...] = (RunConfig,)) -> None:
        super().__init__()
        self._literal_types: dict[Any, LiteralType] = {}
        self._disk_cached = disk_cached

    def get_literal_type(self, t: Any) -> LiteralType:
        found = self._literal_types.get(t)
        if found is None:
            found = self._literal_types[t] = self._load_or_build(t)
        return found

    def _load_or_build(self, t: Any) -> LiteralType:
        if t not in self._disk_cached:
            return super().get_literal_type(t)
        try:
            path = cache_dir() / f"{type_key(t)}.pb"
        except (OSError, TypeError):  # no source to key it on (a bytecode-only install)
            return super().get_literal_type(t)
        found = read_cached(path)
        if found is None:
            found = super().get_literal_type(t)
            write_cached(path, found)
        return found


def register_run_config() -> None:
    """Route `RunConfig` through OnceDataclassTransformer (a no-op when it already is)."""
    register_cached_type(RunConfig)


def register_cached_type(t: type) -> None:
    """Route the dataclass `t` through OnceDataclassTransformer, its literal type kept on disk (a
    no-op when it already is). Call it before a task or workflow names `t` in its interface. The
    disk key covers `t`'s own module and relax_core.config: a dataclass whose fields are
    dataclasses from elsewhere does not belong here."""
    if not isinstance(TypeEngine.get_transformer(t), OnceDataclassTransformer):
        TypeEngine.register_additional_type(OnceDataclassTransformer((t,)), t, override=True)
