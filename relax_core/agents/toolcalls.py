"""A model's reply text -> OpenAI `tool_calls` (pure), in the format the policy was trained to
write, chosen by `env.tool_parser`:

- "hermes" (Qwen, Hermes, most open chat models): `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`, one block per call, anywhere in the reply;
- "llama3_json" (Llama 3.1+): the whole reply is one JSON object `{"name": ..., "parameters"
  (or "arguments"): {...}}`, optionally after `<|python_tag|>`, several separated by ";";
- "none": replies are never parsed; tool calls stay text for the agent to parse.

Parsing changes only the response body: the recorded row keeps the sampled tokens. A block that
is not a valid call (bad JSON, no name, a tool the request did not offer) stays in `content` and
is counted as a parse error. `opening` is the text a call starts with, which the endpoint writes
into the prompt when a request's `tool_choice` requires a call (the model samples the rest).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedReply:
    content: str | None
    """The reply's text without the valid calls; None when nothing else is left."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI tool calls: {id, type: 'function', function: {name, arguments (a JSON string)}}."""
    errors: int = 0
    """Blocks that look like calls but are not valid ones (left in `content`)."""


def _call(obj: Any, tools: Collection[str], args_keys: tuple[str, ...]) -> dict[str, Any] | None:
    """`obj` as an OpenAI tool call, or None when it is not a valid call of an offered tool."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in tools:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _hermes(text: str, tools: Collection[str]) -> ParsedReply:
    calls, errors, kept, at = [], 0, [], 0
    for match in _HERMES.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), tools, ("arguments", "parameters"))
        except json.JSONDecodeError:
            call = None
        if call is None:
            errors += 1
            continue
        calls.append(call)
        kept.append(text[at : match.start()])
        at = match.end()
    if "<tool_call>" in text[_last_end(text) :]:
        errors += 1  # an opened block never closed (cut by the cap or a stop string)
    kept.append(text[at:])
    return _reply("".join(kept), calls, errors)


def _last_end(text: str) -> int:
    end = text.rfind("</tool_call>")
    return 0 if end < 0 else end


def _llama3_json(text: str, tools: Collection[str]) -> ParsedReply:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body[len(_PYTHON_TAG) :].lstrip() if tagged else body
    if not body.startswith("{"):
        return _reply(text, [], int(tagged))
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        try:
            obj, at = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return _reply(text, [], 1)
        call = _call(obj, tools, ("parameters", "arguments"))
        if call is None:
            return _reply(text, [], 1)
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            return _reply("", calls, 0)
        if not rest.startswith(";"):
            return _reply(text, [], 1)
        body, at = rest[1:].lstrip(), 0


def _none(text: str, tools: Collection[str]) -> ParsedReply:
    return _reply(text, [], 0)


def _reply(content: str, calls: list[dict[str, Any]], errors: int) -> ParsedReply:
    if calls:
        content = content.strip()
    return ParsedReply(content or None, calls, errors)


def _hermes_opening(name: str | None) -> str:
    return "<tool_call>\n" + ("" if name is None else f'{{"name": {json.dumps(name)}, "arguments":')


def _llama3_opening(name: str | None) -> str:
    return '{"name": ' + ("" if name is None else f'{json.dumps(name)}, "parameters":')


PARSERS: dict[str, Callable[[str, Collection[str]], ParsedReply]] = {
    "hermes": _hermes,
    "llama3_json": _llama3_json,
    "none": _none,
}
"""env.tool_parser -> the parser of its format."""

OPENINGS: dict[str, Callable[[str | None], str]] = {
    "hermes": _hermes_opening,
    "llama3_json": _llama3_opening,
}
"""The text a call opens with (`name`: of a named function, else any): what a request whose
tool_choice requires a call gets written after its generation prompt. 'none' has none."""


def parse_reply(parser: str, text: str, tools: Collection[str]) -> ParsedReply:
    """`text` split into content and calls of the tools named in `tools`."""
    return PARSERS[parser](text, tools)


def tool_names(tools: list[Any] | None) -> set[str]:
    """The function names a request's `tools` offers."""
    names = set()
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            names.add(fn["name"])
    return names
