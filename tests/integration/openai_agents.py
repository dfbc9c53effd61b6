"""An agent for the integration runs, written against the `openai` client only (no import of
relax_core): the example calculator agent's tool, called on every first turn, without a system prompt (the tiny model's
positions are few), and a log of every response (text and the ids the endpoint reports) to the
JSONL file named by AGENT_CALL_LOG, which the tests check the queue rows against."""

from __future__ import annotations

import json
import os

import openai

from examples.agents.calculator_agent import ANSWER, calculate


def calculator(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": sample["prompt"]}]
    calls = valid = 0
    for _ in range(3):
        try:
            reply = client.chat.completions.create(model=model, messages=messages)
        except openai.BadRequestError:
            break
        text = reply.choices[0].message.content or ""
        _log(reply, text)
        messages.append({"role": "assistant", "content": text})
        # The first turn is always answered by the tool (an untrained model rarely calls it), so
        # every episode is multi-turn.
        if "calc(" not in text and len(messages) > 2:
            found = ANSWER.search(text)
            correct = found is not None and found.group(1) == str(sample["answer"])
            return {"reward": float(correct), "correct": correct}
        calls += 1
        observation = calculate(text)
        valid += not observation.startswith("error")
        messages.append({"role": "tool", "content": observation})
    info = {"tool_calls": calls, "tool_calls_valid": valid}
    return {"reward": 0.0, "correct": False, "info": info}


def _log(reply, text: str) -> None:
    path = os.environ.get("AGENT_CALL_LOG")
    if not path:
        return
    ids = reply.model_extra["relax"]
    line = {
        "text": text,
        "prompt_ids": ids["prompt_token_ids"],
        "sampled_ids": ids["completion_token_ids"],
        "policy_version": ids["policy_version"],
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
