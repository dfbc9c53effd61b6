"""The LangChain calculator agent (langchain_agent.py) with the demonstration a warm start
replays through it (docs/agents.md, "Warm start of an agent run"): the model's turns of a
correct episode, a Hermes tool call of the agent's `calculator` tool and then the answer, as a
policy whose chat template renders tools Hermes style (configs/templates/smollm2-tools.jinja)
is asked to write them.

    env:
      agent: examples.agents.langchain_calculator:solve
"""

from __future__ import annotations

import json

from examples.agents.calculator_agent import evaluate
from examples.agents.langchain_agent import solve

__all__ = ["demonstration", "solve"]


def demonstration(sample: dict) -> list[str]:
    """The turns of a correct episode: call the calculator, then answer with its value."""
    expression = sample["meta"]["expression"]
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return [f"<tool_call>\n{json.dumps(call)}\n</tool_call>", f"Answer: {evaluate(expression)}"]
