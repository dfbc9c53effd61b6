"""A calculator agent written against the `openai` client only (no import of relax_core).

Point any OpenAI client at the base URL the rollout hands an episode and play it: the model
writes `calc(EXPRESSION)` alone in a turn to use the calculator, whose value comes back as a
`tool` message, and `Answer: NUMBER` when it knows the result. Reward 1 for the right answer.

    env:
      agent: examples.agents.calculator_agent:solve
"""

from __future__ import annotations

import ast
import operator
import re

import openai

SYSTEM = (
    "You have a calculator: write calc(EXPRESSION) alone in a turn and it answers with the "
    "value. When you know the result, write Answer: NUMBER."
)
TOOL_CALL = re.compile(r"calc\((.*)\)", re.DOTALL)
ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
MAX_TURNS = 4
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def solve(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": sample["prompt"]},
    ]
    calls = valid = 0
    for _ in range(MAX_TURNS):
        try:
            reply = client.chat.completions.create(model=model, messages=messages)
        except openai.BadRequestError:  # the episode's call or token budget is spent
            break
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        if "calc(" in text:
            calls += 1
            observation = calculate(text)
            valid += not observation.startswith("error")
            messages.append({"role": "tool", "content": observation})
            continue
        found = ANSWER.search(text)
        correct = found is not None and float(found.group(1)) == float(sample["answer"])
        return _result(correct, calls, valid)
    return _result(False, calls, valid)


def _result(correct: bool, calls: int, valid: int) -> dict:
    info = {"tool_calls": calls, "tool_calls_valid": valid}
    return {"reward": float(correct), "correct": correct, "info": info}


def calculate(text: str) -> str:
    """The tool's answer to a turn that calls it: the value, or 'error: <reason>'."""
    found = TOOL_CALL.search(text)
    if not found:
        return "error: no closing ')'"
    return evaluate(found.group(1))


def evaluate(expression: str) -> str:
    """The calculator's answer to an expression: its value, or 'error: <reason>'."""
    try:
        value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"
    return str(value)


def _evaluate(node: ast.AST) -> int:
    """+, - and * of integers, nothing else (never eval() model output)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    raise ValueError("only integers with + - * are allowed")
