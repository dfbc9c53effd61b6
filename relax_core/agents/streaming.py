"""A served response body -> the server-sent events of OpenAI's streaming format (pure).

The engine generates a whole reply before the endpoint answers, so a streamed call is recorded
exactly as an unstreamed one; its chunks follow once the reply is done: chat: the role, the
content, each tool call (index, id, type, name, arguments), the finish reason (with the `relax`
ids), the usage when `stream_options.include_usage` asked, then `data: [DONE]`; text
completions: the text, then the finish reason.
"""

from __future__ import annotations

import json
from typing import Any


def sse(body: dict[str, Any], include_usage: bool) -> bytes:
    """The whole event stream of `body` (a chat.completion or text_completion body)."""
    events = [f"data: {json.dumps(chunk)}\n\n" for chunk in chunks(body, include_usage)]
    return ("".join(events) + "data: [DONE]\n\n").encode()


def chunks(body: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    choice = body["choices"][0]
    chat = body["object"] == "chat.completion"
    head = {
        "id": body["id"],
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": body["created"],
        "model": body["model"],
    }
    if include_usage:
        head["usage"] = None

    def chunk(payload: dict[str, Any], finish: str | None = None, **extra: Any) -> dict:
        return {**head, "choices": [{"index": 0, **payload, "finish_reason": finish}], **extra}

    out = []
    if chat:
        message = choice["message"]
        out.append(chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None}))
        if message.get("content"):
            delta = {"delta": {"content": message["content"]}, "logprobs": choice["logprobs"]}
            out.append(chunk(delta))
        for i, call in enumerate(message.get("tool_calls") or ()):
            delta = {"tool_calls": [{"index": i, **call}]}
            out.append(chunk({"delta": delta, "logprobs": None}))
        out.append(
            chunk({"delta": {}, "logprobs": None}, choice["finish_reason"], relax=body["relax"])
        )
    else:
        if choice["text"]:
            out.append(chunk({"text": choice["text"], "logprobs": choice["logprobs"]}))
        out.append(
            chunk({"text": "", "logprobs": None}, choice["finish_reason"], relax=body["relax"])
        )
    if include_usage:
        out.append({**head, "choices": [], "usage": body["usage"]})
    return out
