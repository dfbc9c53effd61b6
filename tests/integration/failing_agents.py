"""Agents whose every call the endpoint refuses (HTTP 400: `n > 1`), written against the `openai`
client only, for the runs that must stop loudly when every agent episode fails."""

from __future__ import annotations

import json
import os

import openai

_EVAL = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "datasets/calculator/eval.jsonl",
)
with open(_EVAL) as f:
    EVAL_PROMPTS = {json.loads(line)["prompt"] for line in f if line.strip()}


def refused(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    """Asks for two choices a call, which the endpoint refuses: the 400 ends the episode."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    client.chat.completions.create(model=model, messages=messages, n=2)
    return {"reward": 1.0}


def refused_in_training(sample: dict, *, base_url: str, api_key: str, model: str) -> dict:
    """`refused` on training prompts; a held-out prompt ends at once with reward 0 (the eval
    passes, the steps fail)."""
    if sample["prompt"] in EVAL_PROMPTS:
        return {"reward": 0.0}
    return refused(sample, base_url=base_url, api_key=api_key, model=model)
