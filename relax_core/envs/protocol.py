"""The Env protocol an agentic episode runs against, and loading a user's env from 'module:Class'.

An env holds the state of one episode. The multi-turn loop (rollout/multiturn.py) builds one env
per episode, calls `reset(sample)` with the dataset row, then `step(turn_text)` after every model
turn that ended on EOS, and renders each observation through `format_observation` into a chat
message. An env that raises ends its own episode, never the run: the loop records an `EnvFailure`.

Info keys the loop reads (all optional): `correct` (bool, on the step that ends the episode: the
episode counts as a success) and `tool_call_valid` (bool, on a step whose turn made a tool call:
counted for the tool-call validity metric). Every step's info is kept, JSON-encoded, in the row's
`reward_info`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from relax_core.user_code import import_attribute

INFO_CORRECT = "correct"
INFO_TOOL_CALL_VALID = "tool_call_valid"

ENV_METHODS = ("reset", "step", "format_observation")
MAX_ERROR_CHARS = 500
"""Env error messages are cut to this length in the row's reward_info."""


class StepResult(NamedTuple):
    """What `Env.step` returns; a plain 4-tuple in this order is accepted too."""

    observation: Any
    """What the env shows the model next (text, or anything `format_observation` renders)."""
    reward: float
    """Reward for this turn; the episode's reward is the sum over its turns."""
    done: bool
    """True ends the episode; False asks the model for another turn."""
    info: dict[str, Any]
    """JSON-able details (see the module docstring for the keys the loop reads)."""


class Env(Protocol):
    """One episode's environment. Messages are `{"role": str, "content": str}` plus, for a
    multimodal observation, `"media": [{"kind": "image", "bytes": ...} | {"kind", "uri"}]`."""

    def reset(self, sample: Mapping[str, Any]) -> Any:
        """Start an episode for the dataset row `sample` (keys "prompt", "answer", "meta").
        Returns an initial observation shown before the first model turn, or None (the prompt
        says it all, the common case)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Judge one model turn (its decoded text, special tokens removed)."""
        ...

    def format_observation(self, observation: Any) -> dict[str, Any]:
        """The chat message that shows `observation` to the model."""
        ...


EnvFactory = Callable[[], Env]
"""Builds a fresh env for one episode."""


@dataclass(frozen=True)
class EnvFailure:
    """Why an env ended its episode by failing: the record stored in the row's reward_info."""

    phase: str
    """'reset', 'step' or 'format_observation': the env call that failed."""
    error_type: str
    """The exception's class name (or 'InvalidStep' for a malformed step result)."""
    message: str
    """The exception's message, truncated to MAX_ERROR_CHARS."""

    @classmethod
    def from_exception(cls, phase: str, error: BaseException) -> EnvFailure:
        return cls(phase, type(error).__name__, str(error)[:MAX_ERROR_CHARS])

    def to_info(self) -> dict[str, str]:
        return {"phase": self.phase, "type": self.error_type, "message": self.message}


def as_step_result(value: Any) -> StepResult:
    """Check what `step` returned; TypeError/ValueError naming the problem when it is malformed."""
    if not isinstance(value, tuple) or len(value) != 4:
        raise TypeError(
            "step() must return StepResult(observation, reward, done, info) or a 4-tuple, "
            f"got {type(value).__name__}"
        )
    observation, reward, done, info = value
    # numpy scalars and 0-d tensors convert; a string that float() would parse is refused.
    if isinstance(reward, (bool, str, bytes)) or reward is None:
        raise TypeError(f"step() reward must be a number, got {reward!r}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise TypeError(f"step() reward must be a number, got {reward!r}") from None
    if reward != reward or reward in (float("inf"), float("-inf")):
        raise ValueError(f"step() reward must be finite, got {reward}")
    if done not in (True, False):
        raise TypeError(f"step() done must be a bool, got {done!r}")
    if info is None:
        info = {}
    if not isinstance(info, Mapping):
        raise TypeError(f"step() info must be a dict, got {type(info).__name__}")
    return StepResult(observation, reward, bool(done), dict(info))


def missing_methods(env: object) -> list[str]:
    """The Env methods `env` lacks (or has as non-callables), in protocol order."""
    return [name for name in ENV_METHODS if not callable(getattr(env, name, None))]


def load_env(spec: str, **kwargs: Any) -> EnvFactory:
    """A factory of fresh envs from a user's 'module:Class' (dotted attributes are followed).

    One env is built now, with `kwargs`, so a typo, a bad keyword or a class that does not
    satisfy the Env protocol stops the run at config validation, not mid-rollout. Raises
    ValueError (bad spec, module or attribute, or a constructor that raised) or TypeError (not
    a class or callable, wrong keywords, missing protocol methods), each naming `spec`.
    """
    target = _import_attribute(spec)
    if not callable(target):
        raise TypeError(f"env {spec!r} is a {type(target).__name__}, not a class")
    try:
        probe = target(**kwargs)
    except TypeError as e:
        raise TypeError(
            f"env {spec!r} cannot be built with keyword arguments {sorted(kwargs)}: {e}"
        ) from e
    except Exception as e:
        raise ValueError(f"env {spec!r}: building it raised {type(e).__name__}: {e}") from e
    missing = missing_methods(probe)
    if missing:
        raise TypeError(
            f"env {spec!r} does not satisfy the Env protocol: missing method(s) "
            f"{', '.join(missing)} (an env needs {', '.join(ENV_METHODS)})"
        )
    return functools.partial(target, **kwargs)


def _import_attribute(spec: str) -> object:
    target = import_attribute(spec, "env", "'module:Class', e.g. 'my_pkg.envs:Maze'")
    if inspect.ismodule(target):
        raise TypeError(f"env {spec!r} names a module, not a class")
    return target
