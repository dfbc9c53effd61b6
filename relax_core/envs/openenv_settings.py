"""The `env.kwargs` of env 'openenv', parsed and checked: OpenEnvSettings.

Every value arrives from the YAML as a string; each kwarg is parsed to its type here and every
error names the kwarg (`env.kwargs.<name>`) and what it allows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OpenEnvSettings:
    """env.kwargs of env 'openenv' (every value arrives as a string)."""

    env: str = ""
    """'module:Class' of an OpenEnv Environment, built in this process once per episode."""
    url: str = ""
    """An OpenEnv server ('http://host:port'); one WebSocket session per episode."""
    env_args: dict[str, Any] = field(default_factory=dict)
    """JSON object: keyword arguments the `env` class is built with."""
    action_cls: str = ""
    """'module:Class' of the env's Action, when its class does not say (Environment[Act, ...])."""
    action_field: str = ""
    """The Action field that takes the turn text; default: the Action's only string field."""
    action_builder: str = ""
    """'module:function' turning the turn text into an Action (or its dict)."""
    observation_field: str = ""
    """The Observation field shown; default: its only string field, else all fields as JSON."""
    role: str = "user"
    """Chat role of the observation message."""
    show_reset: bool = True
    """Show reset's observation before the first turn (when its text is not empty)."""
    reset_keys: tuple[str, ...] = ("seed", "episode_id")
    """Keys of the row's meta passed to reset() as keyword arguments when present."""
    correct_key: str = ""
    """Metadata key or Observation field whose truth marks the final step a success."""
    success_reward: float | None = 1.0
    """Without correct_key: the final step succeeds when its reward >= this (None: never)."""
    timeout_s: float = 60.0
    """Seconds to connect to `url` and to wait for each of its answers."""

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> OpenEnvSettings:
        """Parse `env.kwargs`; ValueError naming the kwarg and its allowed values."""
        allowed = list(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - set(allowed))
        if unknown:
            raise ValueError(
                f"env.kwargs: unknown key(s) {', '.join(unknown)} for env 'openenv'; "
                f"allowed: {', '.join(allowed)}"
            )
        raw = {k: str(v).strip() for k, v in kwargs.items()}
        s = cls(**{k: _PARSERS.get(k, _text)(k, v) for k, v in raw.items()})
        s._check()
        return s

    def _check(self) -> None:
        if bool(self.env) == bool(self.url):
            raise ValueError(
                "env.kwargs: give exactly one of env ('module:Class' of an OpenEnv Environment, "
                "run in process) or url (an OpenEnv server, 'http://host:port')"
            )
        if self.url and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"env.kwargs.url: expected 'http://host:port', got {self.url!r}")
        if self.url and (self.env_args or self.action_cls):
            raise ValueError("env.kwargs: env_args and action_cls apply to env (in process)")
        if self.action_field and self.action_builder:
            raise ValueError("env.kwargs: give action_field or action_builder, not both")
        if not self.role:
            raise ValueError("env.kwargs.role: must not be empty (e.g. user, tool)")
        if self.timeout_s <= 0:
            raise ValueError(f"env.kwargs.timeout_s: must be > 0, got {self.timeout_s}")


def _text(name: str, text: str) -> str:
    return text.rstrip("/") if name == "url" else text


def _json_object(name: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"env.kwargs.{name}: not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"env.kwargs.{name}: expected a JSON object, got {text!r}")
    return value


def _bool(name: str, text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise ValueError(f"env.kwargs.{name}: expected true or false, got {text!r}")
    return text.lower() == "true"


def _names(name: str, text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if text.lower() != "none" and not all(n.isidentifier() for n in names):
        raise ValueError(f"env.kwargs.{name}: expected comma-separated names or none, got {text!r}")
    return () if text.lower() == "none" else names


def _float(name: str, text: str) -> float | None:
    """A finite number; for success_reward also 'none'."""
    if name == "success_reward" and text.lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        extra = " or none" if name == "success_reward" else ""
        raise ValueError(f"env.kwargs.{name}: expected a number{extra}, got {text!r}")
    return value


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "env_args": _json_object,
    "show_reset": _bool,
    "reset_keys": _names,
    "success_reward": _float,
    "timeout_s": _float,
}
