"""A user's agent: a 'module:function' run once per episode against the OpenAI-compatible endpoint.

    def solve(sample: dict, *, base_url: str, api_key: str, model: str) -> float | dict:
        client = openai.OpenAI(base_url=base_url, api_key=api_key)
        ...  # any number of chat or text completion calls, tools, parsing
        return {"reward": 1.0, "correct": True, "info": {...}}

`sample` is the dataset row (prompt, answer, meta). An `async def` agent is run to completion
with asyncio. The agent returns the episode's reward: a number, or a dict with "reward" (a
number), optionally "correct" (bool: the episode succeeded; default reward > 0) and "info" (a
JSON-able dict kept in the row's reward_info; its "tool_calls" and "tool_calls_valid" counts feed
the tool-call validity metric).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from relax_core.user_code import import_attribute

AGENT_FORM = "'module:function', e.g. 'my_pkg.agents:solve'"
AgentFn = Callable[..., Any]


@dataclass(frozen=True)
class AgentResult:
    reward: float
    correct: bool
    info: dict[str, Any] = field(default_factory=dict)


def load_agent(spec: str) -> AgentFn:
    """The agent function `spec` names, checked to take (sample, base_url=, api_key=, model=);
    ValueError or TypeError naming `spec` otherwise."""
    target = import_attribute(spec, "env.agent", AGENT_FORM)
    if inspect.isclass(target) or not callable(target):
        raise TypeError(f"env.agent {spec!r} is a {type(target).__name__}, not a function")
    try:
        inspect.signature(target).bind({}, base_url="", api_key="", model="")
    except TypeError as e:
        raise TypeError(
            f"env.agent {spec!r} must accept (sample, *, base_url, api_key, model): {e}"
        ) from e
    except ValueError:
        pass  # a builtin without a signature: called as documented
    return target


def call_agent(fn: AgentFn, sample: Mapping[str, Any], base_url: str, api_key: str, model: str):
    """Run one episode's agent to completion (an async agent in an event loop of its own)."""
    value = fn(dict(sample), base_url=base_url, api_key=api_key, model=model)
    if inspect.isawaitable(value):
        value = asyncio.run(_await(value))
    return value


async def _await(awaitable):
    return await awaitable


def parse_result(value: Any) -> AgentResult:
    """What an agent returned -> AgentResult; TypeError/ValueError naming what is wrong."""
    info: dict[str, Any] = {}
    correct = None
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"the agent returned a dict without 'reward': keys {sorted(value)}")
        correct, info = value.get("correct"), value.get("info") or {}
        if correct is not None and not isinstance(correct, bool):
            raise TypeError(f"the agent's 'correct' must be a bool, got {correct!r}")
        if not isinstance(info, Mapping):
            raise TypeError(f"the agent's 'info' must be a dict, got {type(info).__name__}")
        value = value["reward"]
    if isinstance(value, (bool, str, bytes)) or value is None:
        raise TypeError(f"the agent must return a number or a dict with 'reward', got {value!r}")
    try:
        reward = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"the agent's reward must be a number, got {value!r}") from None
    if not math.isfinite(reward):
        raise ValueError(f"the agent's reward must be finite, got {reward}")
    return AgentResult(reward, reward > 0 if correct is None else correct, dict(info))
