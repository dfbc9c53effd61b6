"""The Monitor protocol every experiment tracker implements, plus helpers that need no tracker.

Services talk to a `Monitor` only; which backend sits behind it (MLflow, nothing) is chosen where the
run is wired. This module imports no tracking library, so `NullMonitor` and `flatten_params` are free.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Protocol

# MLflow rejects a param value longer than this (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH).
PARAM_VALUE_MAX_CHARS = 6000
_TRUNCATION_MARK = "...[truncated]"


class Monitor(Protocol):
    """Records one training run: its params and tags once, metrics per step, files at the end."""

    def start(self, params: dict[str, object], tags: dict[str, str]) -> str:
        """Open (or re-open) the run, record params and tags; returns the run id."""
        ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Record scalar metrics for optimizer step `step`; may buffer until `flush`."""
        ...

    def log_artifact(self, path: str) -> None:
        """Attach a local file or directory to the run."""
        ...

    def flush(self) -> None:
        """Send everything buffered so far (what the backend cannot take now is kept and sent
        at a later flush)."""
        ...

    def finish(self, status: str = "FINISHED") -> None:
        """Flush and close the run with `status` (FINISHED, FAILED or KILLED); if the backend
        is down, say where what it did not take is kept."""
        ...


class NullMonitor:
    """A Monitor that records nothing, for runs with tracking switched off."""

    def start(self, params: dict[str, object], tags: dict[str, str]) -> str:
        return ""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        return None

    def log_artifact(self, path: str) -> None:
        return None

    def flush(self) -> None:
        return None

    def finish(self, status: str = "FINISHED") -> None:
        return None


def flatten_params(d: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """Flatten a nested mapping into dotted keys with string values, as trackers store params.

    `{"algo": {"eps_clip": 0.2}, "lr": 1e-6}` -> `{"algo.eps_clip": "0.2", "lr": "1e-06"}`.
    Dataclass instances are flattened like mappings, so a resolved config can be passed as is.
    Values longer than PARAM_VALUE_MAX_CHARS are cut to that length (ending in a visible mark),
    because MLflow refuses the whole batch otherwise. Two inputs that flatten to the same key
    (`{"a.b": 1, "a": {"b": 2}}`) raise ValueError instead of silently keeping one.
    """
    out: dict[str, str] = {}
    _flatten_into(out, d, prefix)
    return out


def _flatten_into(out: dict[str, str], d: Mapping[str, object], prefix: str) -> None:
    for key, value in d.items():
        if not isinstance(key, str):
            raise TypeError(f"param key {key!r} under {prefix or '<root>'!r} must be a str")
        name = f"{prefix}.{key}" if prefix else key
        nested = _as_mapping(value)
        if nested:
            _flatten_into(out, nested, name)
            continue
        if nested is not None:
            value = "{}"  # keep an empty section visible rather than dropping its key
        if name in out:
            raise ValueError(f"param key {name!r} occurs twice after flattening nested keys")
        out[name] = _truncate(str(value))


def _as_mapping(value: object) -> Mapping[str, object] | None:
    if isinstance(value, Mapping):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    return None


def _truncate(text: str) -> str:
    if len(text) <= PARAM_VALUE_MAX_CHARS:
        return text
    return text[: PARAM_VALUE_MAX_CHARS - len(_TRUNCATION_MARK)] + _TRUNCATION_MARK
