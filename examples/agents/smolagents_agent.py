"""The calculator task as smolagents agents on an OpenAI-compatible server, as smolagents' docs
show: a `@tool` calculator, an `OpenAIServerModel`, and either agent type. Nothing here knows
about relax.

    env:
      agent: examples.agents.smolagents_agent:solve_tool_calling   # or :solve_tool_calling_streaming
      agent: examples.agents.smolagents_agent:solve_code           # the CodeAgent

- `ToolCallingAgent`: the model calls tools through the API's `tool_calls`, and answers by
  calling smolagents' `final_answer` tool.
- `CodeAgent`: the model writes Python in `<code>...</code>` blocks, which smolagents runs in
  its local Python executor, in this process (the rollout process): an AST interpreter that
  allows only the listed imports and the given tools, not a sandbox. Model-written code runs
  with the rollout's permissions; use `executor_type="docker"`/"e2b"/... where that matters.
  The policy ends with `final_answer(...)` inside the code.

Offline: smolagents sends nothing anywhere but the model's server (no telemetry unless its
OpenTelemetry instrumentation is installed and enabled).
"""

from __future__ import annotations

from smolagents import CodeAgent, LogLevel, OpenAIServerModel, ToolCallingAgent, tool

from examples.agents.calculator_agent import evaluate

MAX_STEPS = 4


@tool
def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression of integers with +, - and *.

    Args:
        expression: integers joined by +, - and *, e.g. "3*4-5".
    """
    return evaluate(expression)


def solve_tool_calling(
    sample: dict, *, base_url: str, api_key: str, model: str, stream: bool = False
) -> dict:
    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key=api_key)
    agent = ToolCallingAgent(
        tools=[calculator],
        model=llm,
        max_steps=MAX_STEPS,
        stream_outputs=stream,
        verbosity_level=LogLevel.OFF,
    )
    answer = agent.run(sample["prompt"])
    return _scored(agent, answer, sample["answer"])


def solve_tool_calling_streaming(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    """The ToolCallingAgent with `stream_outputs=True` (`stream=true` requests)."""
    return solve_tool_calling(sample, base_url=base_url, api_key=api_key, model=model, stream=True)


def solve_code(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    llm = OpenAIServerModel(model_id=model, api_base=base_url, api_key=api_key)
    agent = CodeAgent(
        tools=[calculator], model=llm, max_steps=MAX_STEPS, verbosity_level=LogLevel.OFF
    )
    answer = agent.run(sample["prompt"])
    return _scored(agent, answer, sample["answer"])


def _scored(agent: ToolCallingAgent | CodeAgent, answer: object, expected: str) -> dict:
    """Reward 1 for the right final answer; a step's tool calls (a CodeAgent's code action is
    one) count as valid when the step raised no error."""
    calls = valid = 0
    for step in agent.memory.steps:
        made = [c for c in getattr(step, "tool_calls", None) or () if c.name != "final_answer"]
        calls += len(made)
        valid += len(made) if getattr(step, "error", None) is None else 0
    try:
        correct = float(str(answer).strip()) == float(expected)
    except ValueError:
        correct = False
    info = {"tool_calls": calls, "tool_calls_valid": valid}
    return {"reward": float(correct), "correct": correct, "info": info}
