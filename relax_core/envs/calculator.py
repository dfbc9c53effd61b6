"""Calculator tool env: multiply a 3-digit by a 2-digit number, with a calculator to call.

The task ("What is 347*58?") is beyond mental arithmetic for a tiny model, but easy with the tool:
    model:  calc(347*58)          one tool call per turn, evaluated by envs/arith.py (no eval())
    tool:   20126                 the observation; an invalid call gets "error: <reason>" instead
    model:  Answer: 20126         a turn without a tool call is final and ends the episode
Reward 1 for a final answer equal to the row's answer, else 0. Every format uses only characters
of the tiny char tokenizer (no angle brackets), so a short supervised warm start on
`demonstration` transcripts teaches it; what RL then learns is to copy exactly.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from relax_core.envs.arith import CalcError, evaluate, format_number
from relax_core.envs.protocol import INFO_CORRECT, INFO_TOOL_CALL_VALID, StepResult

TOOL_CALL = re.compile(r"calc\((.*)\)", re.DOTALL)
# A turn that opens a call but never closes it is still a (malformed) tool call, not an answer.
TOOL_OPEN = "calc("
ANSWER = re.compile(r"Answer:\s*(-?\d+(?:\.\d+)?)")
SYSTEM_PROMPT = (
    "You have a calculator: write calc(EXPRESSION) alone in a turn and it answers with the "
    "value. When you know the result, write Answer: NUMBER."
)
"""An instruction for chat models (data.system_prompt); the tiny model learns the format instead."""

LOW_A, HIGH_A = 100, 999
LOW_B, HIGH_B = 10, 99


class CalculatorEnv:
    """One episode: tool calls until a turn without one, which is read as the final answer."""

    def __init__(self) -> None:
        self.answer: Fraction | None = None

    def reset(self, sample: Mapping[str, Any]) -> None:
        self.answer = Fraction(str(sample["answer"]).strip())
        return None

    def step(self, action_text: str) -> StepResult:
        if self.answer is None:
            raise RuntimeError("step() before reset()")
        if TOOL_OPEN in action_text:
            return self._tool_call(action_text)
        found = ANSWER.search(action_text)
        given = found.group(1) if found else None
        correct = given is not None and Fraction(given) == self.answer
        info = {INFO_CORRECT: correct, "answer": given}
        return StepResult(None, 1.0 if correct else 0.0, True, info)

    def _tool_call(self, action_text: str) -> StepResult:
        found = TOOL_CALL.search(action_text)
        expression = found.group(1) if found else action_text.split(TOOL_OPEN, 1)[1]
        info: dict[str, Any] = {"expression": expression[:80]}
        try:
            if not found:
                raise CalcError("bad expression", "no closing ')'")
            result = format_number(evaluate(expression))
        except CalcError as err:
            info.update({INFO_TOOL_CALL_VALID: False, "error": str(err)})
            return StepResult(f"error: {err.reason}", 0.0, False, info)
        info.update({INFO_TOOL_CALL_VALID: True, "result": result})
        return StepResult(result, 0.0, False, info)

    def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "tool", "content": str(observation)}


def _row(a: int, b: int) -> dict[str, Any]:
    expression = f"{a}*{b}"
    return {
        "prompt": f"What is {expression}?\n",
        "answer": str(a * b),
        "meta": {"env": "calculator", "expression": expression},
    }


def generate(
    seed: int = 0, train_size: int = 4000, eval_size: int = 128
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train_rows, eval_rows): distinct a*b questions, 100 <= a <= 999, 10 <= b <= 99, the two
    splits disjoint; the same seed gives the same rows."""
    n_b = HIGH_B - LOW_B + 1
    total = (HIGH_A - LOW_A + 1) * n_b
    if train_size + eval_size > total:
        raise ValueError(f"at most {total} distinct questions, asked for {train_size + eval_size}")
    picks = random.Random(seed).sample(range(total), train_size + eval_size)
    rows = [_row(LOW_A + i // n_b, LOW_B + i % n_b) for i in picks]
    return rows[eval_size:], rows[:eval_size]


def demonstration(sample: Mapping[str, Any]) -> list[str]:
    """The model turns of a correct episode for `sample`: call the tool, then answer."""
    expression = (sample.get("meta") or {}).get("expression")
    if not expression:
        found = re.search(r"What is (.+)\?", str(sample["prompt"]))
        if not found:
            raise ValueError(f"no expression in calculator prompt {sample['prompt']!r}")
        expression = found.group(1)
    return [f"calc({expression})", f"Answer: {sample['answer']}"]
