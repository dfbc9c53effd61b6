"""A decoded OpenAI request body -> the Request the endpoint serves, or RequestError (HTTP 400)
naming the field (pure).

Every field is honoured, accepted at its no-op value, or refused; none is ignored:
- honoured: model, messages, tools, tool_choice, parallel_tool_calls, prompt, max_tokens /
  max_completion_tokens, logprobs, stop, stream, stream_options.include_usage, n = 1;
- the run's temperature and top_p always apply (the trainer scores the distribution the run was
  configured with): a request asking for others is served with the run's and counted;
- accepted, as they change nothing the model samples: user, safety_identifier, metadata,
  service_tier, prompt_cache_key / _retention / _options, store: false;
- accepted only at their no-op value, else refused: frequency_penalty and presence_penalty 0,
  logit_bias {}, top_logprobs 0, response_format {"type": "text"}, store / echo false,
  best_of 1 (NOOP below); seed, reasoning_effort and the others NOOP gives no value for are
  refused whenever set (there is no guided decoding and no seeded sampling);
- any other field is refused, so a request never silently gets less than it asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TOOL_CHOICES = ("auto", "none", "required")

SERVED = {
    "model",
    "messages",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "stop",
    "stream",
    "stream_options",
    "n",
    "temperature",
    "top_p",
}
"""Fields the endpoint reads."""
INERT = {
    "user",
    "safety_identifier",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
}
"""Fields that change nothing the model samples: accepted with any value."""
NOOP: dict[str, tuple[Any, ...]] = {
    "seed": (),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "top_logprobs": (0,),
    "response_format": ({"type": "text"},),
    "store": (False,),
    "echo": (False,),
    "best_of": (1,),
    "suffix": ("",),
    "reasoning_effort": (),
    "verbosity": (),
    "functions": ([],),
    "function_call": (),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
}
"""Fields the endpoint cannot honour: accepted absent (or null) or at these values only."""
_WHY = {
    "seed": "sampling uses the engine's own random state",
    "response_format": "there is no guided decoding; ask for JSON in the prompt",
    "store": "the endpoint keeps no completions to retrieve",
    "functions": "use tools",
    "function_call": "use tool_choice",
    "top_logprobs": "logprobs of the sampled tokens are served",
}


class RequestError(Exception):
    """A request the endpoint refuses: `status` and an OpenAI-style error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.status, self.param = status, param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class Request:
    """What the endpoint takes from a chat or text completion request."""

    kind: str
    """'chat' or 'completion'."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """chat: messages with None fields dropped and text parts joined."""
    tools: list | None = None
    """chat: tool schemas, passed to the chat template."""
    tool_choice: str = "auto"
    """'auto', 'none' (tools rendered, the reply not parsed), 'required' (a call is opened in
    the prompt), or 'function' (a call of `tool_name` is opened)."""
    tool_name: str | None = None
    parallel_tool_calls: bool = True
    """False: at most one call is returned."""
    prompt: str | list[int] = ""
    """completion: text, or token ids taken as they are."""
    max_tokens: int | None = None
    logprobs: bool = False
    sampling_asked: bool = False
    """The request set temperature or top_p (the run's apply)."""
    model: str = ""
    stop: tuple[str, ...] = ()
    """The reply ends at the first of these strings."""
    stream: bool = False
    include_usage: bool = False
    """stream: a last chunk carries the usage."""


def parse_request(kind: str, body: Any) -> Request:
    """Check a decoded JSON body of `kind` ('chat' or 'completion'); RequestError names what is
    wrong."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    _check_fields(kind, body)
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(
            f"n={n!r}: one choice per call (a group's samples are separate episodes)", "n"
        )
    if kind == "completion" and body.get("logprobs") not in (None, 0, 1, True, False):
        raise RequestError(
            "top_logprobs is not supported; logprobs of the sampled tokens are", "logprobs"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise RequestError(
            f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens"
        )
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
        raise RequestError(
            f"stream_options: only include_usage is served, got {options!r}", "stream_options"
        )
    common = {
        "kind": kind,
        "max_tokens": max_tokens,
        "logprobs": bool(body.get("logprobs")),
        "sampling_asked": body.get("temperature") is not None or body.get("top_p") is not None,
        "model": str(body.get("model") or ""),
        "stop": _stop(body.get("stop")),
        "stream": bool(stream),
        "include_usage": bool(stream and options.get("include_usage")),
    }
    if kind == "chat":
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list of tool schemas", "tools")
        choice, name = _tool_choice(body.get("tool_choice"), tools or None)
        parallel = body.get("parallel_tool_calls")
        if parallel not in (None, True, False):
            raise RequestError(
                f"parallel_tool_calls must be true or false, got {parallel!r}",
                "parallel_tool_calls",
            )
        return Request(
            messages=_messages(body.get("messages")),
            tools=tools or None,
            tool_choice=choice,
            tool_name=name,
            parallel_tool_calls=parallel is not False,
            **common,
        )
    for name in ("tools", "tool_choice", "parallel_tool_calls", "messages"):
        if body.get(name) is not None:
            raise RequestError(f"{name} is a chat field; use /chat/completions", name)
    return Request(prompt=_prompt(body.get("prompt")), **common)


def _check_fields(kind: str, body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if value is None or name in SERVED or name in INERT:
            continue
        if name not in NOOP:
            raise RequestError(
                f"{name}: not a field the endpoint serves (docs/agents.md lists what it takes)",
                name,
            )
        if value not in NOOP[name]:
            why = _WHY.get(name, "the endpoint cannot honour it")
            raise RequestError(f"{name}={value!r} is not supported: {why}", name)


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("stop must be a string or a list of strings", "stop")
    if len(stops) > 4:
        raise RequestError(f"stop: at most 4 strings, got {len(stops)}", "stop")
    return tuple(s for s in stops if s)


def _tool_choice(value: Any, tools: list | None) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str) and value in TOOL_CHOICES:
        if value == "required" and not tools:
            raise RequestError("tool_choice 'required' needs tools", "tool_choice")
        return value, None
    fn = value.get("function") if isinstance(value, Mapping) else None
    if (
        isinstance(value, Mapping)
        and value.get("type") == "function"
        and isinstance(fn, Mapping)
        and isinstance(fn.get("name"), str)
    ):
        names = [t.get("function", {}).get("name") for t in tools or () if isinstance(t, Mapping)]
        if fn["name"] not in names:
            raise RequestError(
                f"tool_choice names {fn['name']!r}, which is not among the tools", "tool_choice"
            )
        return "function", fn["name"]
    raise RequestError(
        f"tool_choice must be one of {TOOL_CHOICES} or "
        f'{{"type": "function", "function": {{"name": ...}}}}, got {value!r}',
        "tool_choice",
    )


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a 'role'", "messages")
        clean = {k: v for k, v in message.items() if v is not None}
        clean["content"] = _text_content(message.get("content"), i)
        out.append(clean)
    return out


def _text_content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise RequestError(
                    f"messages[{i}].content: part of type {kind!r}; the endpoint takes text parts",
                    "messages",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise RequestError(f"messages[{i}].content must be text or a list of text parts", "messages")


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        return _prompt(value[0])  # a batch of one
    if (
        isinstance(value, list)
        and value
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    ):
        return list(value)
    raise RequestError("prompt must be a non-empty string or a list of token ids", "prompt")
