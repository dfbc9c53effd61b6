"""Env names a config may use: the shipped envs by name, or a user's own env as 'module:Class'."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relax_core.envs import calculator, guess_number
from relax_core.envs.calculator import CalculatorEnv
from relax_core.envs.guess_number import GuessNumberEnv
from relax_core.envs.openenv import OpenEnvEnv
from relax_core.envs.protocol import EnvFactory, load_env

ENVS: dict[str, type] = {
    "calculator": CalculatorEnv,
    "guess_number": GuessNumberEnv,
    "openenv": OpenEnvEnv,
}
DEMONSTRATIONS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "calculator": calculator.demonstration,
    "guess_number": guess_number.demonstration,
}
"""The model turns of a correct episode for a row, per shipped env (for a supervised warm start)."""


def resolve_env(name: str, **kwargs: Any) -> EnvFactory:
    """A factory of fresh envs for `name`: a shipped env ('calculator', 'guess_number',
    'openenv') or a user env 'module:Class'. One env is built now so a bad name or keyword
    fails early; raises ValueError or TypeError naming the env."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"env name must be a non-empty string, got {name!r}")
    name = name.strip()
    if name in ENVS:
        return load_env(f"{ENVS[name].__module__}:{ENVS[name].__qualname__}", **kwargs)
    if ":" in name:
        return load_env(name, **kwargs)
    raise ValueError(
        f"unknown env {name!r}; shipped envs: {', '.join(sorted(ENVS))}; "
        "a user env is given as 'module:Class' (e.g. 'my_pkg.envs:Maze')"
    )
