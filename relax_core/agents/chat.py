"""OpenAI request bodies -> prompt ids, and sampled ids -> OpenAI response bodies.

Token in, token out: a chat request whose messages are the previous request's messages, then the
assistant reply the endpoint returned (unchanged), then new messages, is rendered as the previous
call's exact tokens (prompt + sampled, EOS included) followed by the chat-template text of the new
messages only (rollout/observations.continuation_text). History is never re-rendered, so a
template that rewrites earlier turns (thinking models drop old reasoning) cannot change tokens the
engine sampled. Anything else (a first call, an edited history, a reply cut by the token cap) is
rendered whole through the template, and the recorder starts a new segment. A text completion
request whose prompt starts with the previous prompt + completion text gets the same treatment;
a prompt given as token ids is taken as it is.

What the endpoint cannot honour is refused with RequestError (HTTP 400) naming the field: n > 1,
stream, stop sequences, top_logprobs, non-text content parts. The run's temperature and top_p
always apply (the trainer scores the sampling distribution it was configured with); a request
asking for others is served with the run's and counted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_core.rollout.observations import continuation_text

MAX_PROMPT_TOKENS = 1 << 20


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
    prompt: str | list[int] = ""
    """completion: text, or token ids taken as they are."""
    max_tokens: int | None = None
    logprobs: bool = False
    sampling_asked: bool = False
    """The request set temperature or top_p (the run's apply)."""
    model: str = ""


@dataclass
class Conversation:
    """What the next call of an episode may extend."""

    tokens: list[int] = field(default_factory=list)
    """The previous call's prompt + sampled ids."""
    messages: list[dict[str, Any]] | None = None
    reply: dict[str, Any] | None = None
    text: str | None = None
    """completion: the previous prompt text + the completion text returned."""
    ended_on_eos: bool = False


def parse_request(kind: str, body: Any) -> Request:
    """Check a decoded JSON body of `kind` ('chat' or 'completion'); RequestError names what is
    wrong."""
    if not isinstance(body, Mapping):
        raise RequestError("the request body must be a JSON object")
    n = body.get("n", 1)
    if n not in (None, 1):
        raise RequestError(
            f"n={n!r}: one choice per call (a group's samples are separate episodes)", "n"
        )
    if body.get("stream"):
        raise RequestError("stream=true is not supported; ask for the whole response", "stream")
    if body.get("stop"):
        raise RequestError(
            "stop sequences are not supported: a turn ends at the model's end-of-turn token or "
            "the token cap (cutting it elsewhere would train tokens the agent never saw)",
            "stop",
        )
    top = body.get("top_logprobs")
    if top not in (None, 0) or (kind == "completion" and body.get("logprobs") not in (None, 0, 1)):
        raise RequestError(
            "top_logprobs is not supported; logprobs of the sampled tokens are", "top_logprobs"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise RequestError(
            f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens"
        )
    common = {
        "kind": kind,
        "max_tokens": max_tokens,
        "logprobs": bool(body.get("logprobs")),
        "sampling_asked": body.get("temperature") is not None or body.get("top_p") is not None,
        "model": str(body.get("model") or ""),
    }
    if kind == "chat":
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise RequestError("tools must be a list of tool schemas", "tools")
        return Request(messages=_messages(body.get("messages")), tools=tools or None, **common)
    return Request(prompt=_prompt(body.get("prompt")), **common)


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


class PromptRenderer:
    """A request -> the prompt ids the engine generates from, extending the conversation's
    tokens where the request continues it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)

    def prompt_ids(self, req: Request, conv: Conversation) -> list[int]:
        ids = self._chat(req, conv) if req.kind == "chat" else self._completion(req, conv)
        if not ids:
            raise RequestError("the prompt renders to no tokens")
        if len(ids) > MAX_PROMPT_TOKENS:
            raise RequestError(f"the prompt has {len(ids)} tokens (at most {MAX_PROMPT_TOKENS})")
        return ids

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _chat(self, req: Request, conv: Conversation) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "the policy's tokenizer has no chat template: use /v1/completions, or give the "
                "run one (model.chat_template)"
            )
        msgs, n = req.messages, len(conv.messages or ())
        if (
            conv.messages is not None
            and conv.ended_on_eos
            and len(msgs) > n + 1
            and msgs[:n] == conv.messages
            and _is_reply(msgs[n], conv.reply)
        ):
            try:
                text = continuation_text(self.tokenizer, msgs[n + 1 :], req.tools)
            except ValueError:
                text = None  # the template cannot render them alone: render the whole history
            if text is not None:
                return conv.tokens + self._ids(text)
        try:
            extra = {"tools": req.tools} if req.tools else {}
            text = self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, **extra
            )
        except Exception as err:  # noqa: BLE001 - a template's own refusal, shown to the agent
            raise RequestError(
                f"the chat template refused the messages: {err}", "messages"
            ) from err
        return self._ids(text)

    def _completion(self, req: Request, conv: Conversation) -> list[int]:
        prompt = req.prompt
        if isinstance(prompt, list):
            bad = [t for t in prompt if t >= self.vocab_size]
            if bad:
                raise RequestError(
                    f"prompt token id {bad[0]} is outside the vocabulary ({self.vocab_size})",
                    "prompt",
                )
            return prompt
        if conv.text is not None and prompt.startswith(conv.text):
            return conv.tokens + self._ids(prompt[len(conv.text) :])
        return self._ids(prompt)

    def text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids]


def _is_reply(message: Mapping[str, Any], reply: Mapping[str, Any] | None) -> bool:
    """`message` is the assistant reply the endpoint returned, sent back unchanged."""
    if reply is None or message.get("role") != "assistant":
        return False
    extra = set(message) - {"role", "content", "name"}
    return not extra and message.get("content", "") == reply.get("content", "")


def remember(
    conv: Conversation,
    req: Request,
    prompt_ids: list[int],
    sampled: list[int],
    text: str,
    eos: bool,
) -> None:
    """After a call: what the next call of the episode may extend."""
    conv.tokens = list(prompt_ids) + list(sampled)
    conv.ended_on_eos = eos
    if req.kind == "chat":
        conv.messages, conv.reply = req.messages, {"role": "assistant", "content": text}
        conv.text = None
    else:
        conv.messages = conv.reply = None
        conv.text = req.prompt + text if isinstance(req.prompt, str) else None


def response_body(
    req: Request,
    served_model: str,
    text: str,
    prompt_ids: list[int],
    sampled: list[int],
    logprobs: list[float],
    finish_reason: str,
    version: int,
    token_texts: list[str] | None,
) -> dict[str, Any]:
    """The OpenAI response body for one call; `relax` adds the exact ids and the version."""
    usage = {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(sampled),
        "total_tokens": len(prompt_ids) + len(sampled),
    }
    extra = {
        "prompt_token_ids": prompt_ids,
        "completion_token_ids": sampled,
        "policy_version": version,
    }
    created = int(time.time())
    model = req.model or served_model
    if req.kind == "chat":
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        if req.logprobs and token_texts is not None:
            choice["logprobs"] = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(token_texts, logprobs, strict=True)
                ]
            }
        kind, prefix = "chat.completion", "chatcmpl"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        if req.logprobs and token_texts is not None:
            offsets, at = [], 0
            for t in token_texts:
                offsets.append(at)
                at += len(t)
            choice["logprobs"] = {
                "tokens": token_texts,
                "token_logprobs": logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        kind, prefix = "text_completion", "cmpl"
    return {
        "id": f"{prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": usage,
        "relax": extra,
    }
