"""Strict loading of run configs: YAML or JSON -> RunConfig, every problem reported at once.

Hand-written rather than pydantic or mashumaro (which flytekit brings): both stop at the first
bad field or need their own model classes, while a user fixing a config wants every unknown field,
wrong type and bad value of a file in one message, each named by its dotted path. The coercion
below is the whole of it (ints are accepted for floats, nothing else); value checks are checks.py.

Imports neither torch nor flytekit, so a config can be checked anywhere in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from relax_core.config.checks import validate
from relax_core.config.sections import RunSections

_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
"""A number in exponent notation: `lr: 1e-6` is text to PyYAML (YAML 1.1 wants `1.0e-6`), and to
flytekit's YAML reading of `--cfg`, but a number to YAML 1.2 and to whoever wrote it."""


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem found."""


@dataclass(frozen=True)
class RunConfig(RunSections):
    """A whole run's config; `pyflyte run ... --cfg x.yaml` builds one with `from_json`."""

    def __post_init__(self) -> None:
        # Parts of the run's state left unset live under storage.root; resolved here, so every
        # task (and cfg_json) sees the explicit place.
        for section, values in derived_locations(self).items():
            resolved = dataclasses.replace(getattr(self, section), **values)
            object.__setattr__(self, section, resolved)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """Strict parse of a JSON document; `pyflyte run --cfg x.yaml` hands the YAML to this."""
        return config_from_dict(json.loads(text))


def _under(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}" if "://" in root else os.path.join(root, name)


def derived_locations(cfg: RunSections) -> dict[str, dict[str, str]]:
    """section -> {field: value} for the storage places `cfg` leaves empty."""
    root, endpoint = cfg.storage.root, cfg.storage.endpoint_url
    out: dict[str, dict[str, str]] = {"queue": {}, "checkpoint": {}}
    if not cfg.queue.root:
        out["queue"]["root"] = _under(root, "queue")
    queue_root = cfg.queue.root or out["queue"]["root"]
    if endpoint and not cfg.queue.endpoint_url and queue_root.startswith(("s3://", "s3a://")):
        out["queue"]["endpoint_url"] = endpoint
    if not cfg.checkpoint.dir:
        out["checkpoint"]["dir"] = _under(root, "checkpoints")
    if not cfg.checkpoint.policy_cache_dir:
        out["checkpoint"]["policy_cache_dir"] = _under(root, "policies")
    return {k: v for k, v in out.items() if v}


# --------------------------------------------------------------------------- loading


def _coerce(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats, nothing else."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, errors)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], path, errors)
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-6 (no dot) as text: it means the number
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"{path or 'config'}: expected a mapping of fields, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            errors.append(f"{where}: unknown field; allowed here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            where = f"{path}.{name}" if path else name
            kwargs[name] = _coerce(data[name], hints[name], where, errors)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        errors.append(f"{path or 'config'}: {exc}")
        return cls()


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig; raises ConfigError listing every problem."""
    errors: list[str] = []
    cfg = _build(RunConfig, data, "", errors)
    if not errors:
        errors.extend(validate(cfg))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return cfg


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML run config strictly (unknown fields and wrong types are errors)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (cwd {Path.cwd()})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def replace(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """Copy of cfg with fields of sections changed, e.g. replace(cfg, train={"total_steps": 5})."""
    data = config_to_dict(cfg)
    if "storage" in sections:  # places derived from the old root follow the new one
        for section, values in derived_locations(RunSections(storage=cfg.storage)).items():
            for name, value in values.items():
                if data[section][name] == value:
                    data[section][name] = ""
    for section, values in sections.items():
        if isinstance(values, dict):
            data[section].update(values)
        else:
            data[section] = values
    return config_from_dict(data)
