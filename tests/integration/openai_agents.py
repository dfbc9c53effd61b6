"""An agent for the integration runs, written against the `openai` client only (no import of
relax_core): the example calculator agent's tool, called on every first turn, without a system prompt (the tiny model's
positions are few), and a log of every response (text and the ids the endpoint reports) to the
JSONL file named by AGENT_CALL_LOG, which the tests check the queue rows against. With
AGENT_STREAM_STOP set, every call streams (`stream=True`) and ends at the first of those
comma-separated stop strings, as agents that stop on markers do."""

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
            text = _call(client, model, messages)
        except openai.BadRequestError:
            break
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


def _call(client: openai.OpenAI, model: str, messages: list[dict]) -> str:
    """One call's text, logged with the ids the endpoint reports."""
    stop = os.environ.get("AGENT_STREAM_STOP")
    if not stop:
        reply = client.chat.completions.create(model=model, messages=messages)
        text = reply.choices[0].message.content or ""
        _log(reply.model_extra["relax"], text, reply.choices[0].finish_reason)
        return text
    stream = client.chat.completions.create(
        model=model, messages=messages, stream=True, stop=stop.split(",")
    )
    parts, ids, finish = [], None, None
    for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        ids = (chunk.model_extra or {}).get("relax") or ids
    text = "".join(parts)
    _log(ids, text, finish)
    return text


def _log(ids: dict, text: str, finish: str | None) -> None:
    path = os.environ.get("AGENT_CALL_LOG")
    if not path:
        return
    line = {
        "text": text,
        "finish_reason": finish,
        "prompt_ids": ids["prompt_token_ids"],
        "sampled_ids": ids["completion_token_ids"],
        "policy_version": ids["policy_version"],
    }
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")
