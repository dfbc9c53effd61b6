"""The calculator task as an OpenAI Agents SDK agent: an `Agent` with a `@function_tool` on a Chat
Completions model of any OpenAI-compatible server, as the SDK's docs show for other providers.
`Runner` runs the tool calls and the turns; nothing here knows about relax.

    env:
      agent: examples.agents.openai_agents_sdk_agent:solve    # or :solve_streaming

Offline: the SDK uploads traces to OpenAI unless tracing is disabled; each run here sets
`RunConfig(tracing_disabled=True)` (OPENAI_AGENTS_DISABLE_TRACING=1 does the same process-wide).
"""

from __future__ import annotations

from agents import (
    Agent,
    MaxTurnsExceeded,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
)
from agents.result import RunResultBase
from openai import AsyncOpenAI

from examples.agents.calculator_agent import ANSWER, evaluate

INSTRUCTIONS = "Use the calculator for arithmetic. When you know the result, write Answer: NUMBER."
MAX_TURNS = 4
OFFLINE = RunConfig(tracing_disabled=True)


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *.

    Args:
        expression: integers joined by +, - and *, e.g. "3*4-5".
    """
    return evaluate(expression)


def _agent(base_url: str, api_key: str, model: str) -> Agent:
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    return Agent(
        name="calculator",
        instructions=INSTRUCTIONS,
        tools=[calculator],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
    )


async def solve(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    agent = _agent(base_url, api_key, model)
    try:
        result = await Runner.run(agent, sample["prompt"], max_turns=MAX_TURNS, run_config=OFFLINE)
    except MaxTurnsExceeded:
        return _reward(False, 0, 0)
    return _scored(result, sample["answer"])


async def solve_streaming(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    """The same agent run with `Runner.run_streamed` (`stream=true` requests)."""
    agent = _agent(base_url, api_key, model)
    result = Runner.run_streamed(agent, sample["prompt"], max_turns=MAX_TURNS, run_config=OFFLINE)
    try:
        async for _event in result.stream_events():
            pass  # a UI would show the events; the run's items are kept on `result`
    except MaxTurnsExceeded:
        return _reward(False, 0, 0)
    return _scored(result, sample["answer"])


def _scored(result: RunResultBase, answer: str) -> dict:
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    valid = sum(not str(item.output).startswith("error") for item in outputs)
    found = ANSWER.search(str(result.final_output or ""))
    correct = found is not None and float(found.group(1)) == float(answer)
    return _reward(correct, len(calls), valid)


def _reward(correct: bool, calls: int, valid: int) -> dict:
    info = {"tool_calls": calls, "tool_calls_valid": valid}
    return {"reward": float(correct), "correct": correct, "info": info}
