"""The calculator task as a LangChain agent: a chat model with a tool bound, and the tool-calling
loop LangChain's docs show (run each of the reply's `tool_calls`, send the results back as
`ToolMessage`s, until the model answers in text). Nothing here knows about relax.

    env:
      agent: examples.agents.langchain_agent:solve            # or :solve_streaming

Offline: LangChain traces to LangSmith only when LANGSMITH_TRACING is set; leave it unset in
the rollout image. The endpoint's tool-call parser (env.tool_parser) turns the model's text into
the `tool_calls` the loop reads.
"""

from __future__ import annotations

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from examples.agents.calculator_agent import ANSWER, evaluate

SYSTEM = "Use the calculator for arithmetic. When you know the result, write Answer: NUMBER."
MAX_TURNS = 4


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of integers with +, - and *, e.g. "3*4-5"."""
    return evaluate(expression)


def _invalid_arguments(err: Exception) -> str:
    return f"error: invalid arguments: {err}"


# A call whose arguments do not fit the schema (a model learning the tool writes some) answers
# the model with the error, as LangChain's ToolNode does, instead of raising out of the episode.
calculator.handle_validation_error = _invalid_arguments


def solve(
    sample: dict, *, base_url: str, api_key: str, model: str, streaming: bool = False
) -> dict:
    llm = ChatOpenAI(
        base_url=base_url, api_key=api_key, model=model, streaming=streaming
    ).bind_tools([calculator])
    messages = [SystemMessage(SYSTEM), HumanMessage(sample["prompt"])]
    for _ in range(MAX_TURNS):
        reply = llm.invoke(messages)
        messages.append(reply)
        if not reply.tool_calls and not reply.invalid_tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(calculator.invoke(call))  # a ToolMessage answering this call
    return _result(messages, sample["answer"])


def solve_streaming(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    """The same agent on a streaming chat model (`stream=true` requests, chunks merged)."""
    return solve(sample, base_url=base_url, api_key=api_key, model=model, streaming=True)


def _result(messages: list, answer: str) -> dict:
    replies = [m for m in messages if isinstance(m, AIMessage)]
    calls = sum(len(m.tool_calls) + len(m.invalid_tool_calls) for m in replies)
    results = [m for m in messages if m.type == "tool"]
    valid = sum(m.status != "error" and not str(m.content).startswith("error") for m in results)
    found = ANSWER.search(replies[-1].text) if replies else None
    correct = found is not None and float(found.group(1)) == float(answer)
    info = {"tool_calls": calls, "tool_calls_valid": valid}
    return {"reward": float(correct), "correct": correct, "info": info}
