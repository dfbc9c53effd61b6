"""Requests -> prompt ids, and sampled ids -> OpenAI response bodies (request.py checks a request).

Token in, token out: a chat request whose messages are the previous request's messages, then the
assistant reply the endpoint returned (as frameworks send it back: content and/or tool_calls,
arguments possibly re-serialized, extra empty keys), then new messages (tool results, a user
turn), is rendered as the previous call's exact tokens (prompt + sampled) followed by the
chat-template text of the new messages only (rollout/observations.continuation_text). A reply
that ended on the model's end-of-turn token continues right after it; a reply cut at a stop
string gets the template's end-of-turn text first (observation tokens, never trained). History is
never re-rendered, so a template that rewrites earlier turns (thinking models drop old
reasoning) cannot change tokens the engine sampled. Anything else (a first call, an edited
history, a reply cut by the token cap) is rendered whole through the template, and the recorder
starts a new segment. A text completion request whose prompt starts with the previous prompt +
the text of the sampled tokens gets the same treatment; a prompt given as token ids is taken as
it is.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_core.agents.request import Request, RequestError
from relax_core.agents.toolcalls import OPENINGS
from relax_core.rollout.observations import continuation_text

MAX_PROMPT_TOKENS = 1 << 20
# A tool the template is shown once, to learn whether it renders tools at all.
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "relax_probe_tool",
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
# Keys frameworks add to an assistant message they send back, empty.
_EMPTY = (None, "", [], {})


@dataclass
class Conversation:
    """What the next call of an episode may extend."""

    tokens: list[int] = field(default_factory=list)
    """The previous call's prompt + sampled ids."""
    messages: list[dict[str, Any]] | None = None
    reply: dict[str, Any] | None = None
    """chat: the assistant message returned (content, tool_calls)."""
    text: str | None = None
    """completion: the previous prompt text + the text of the sampled ids."""
    reopen: str | None = None
    """chat: the text between the previous sampled ids and the next messages' template text:
    '' after the model's end-of-turn, the template's end-of-turn after a stop string, None when
    the reply cannot be continued (cut by the token cap)."""


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    """Prompt ids, the forced opening of a tool call (tool_choice) included."""
    opening: str = ""
    """The text of a tool call the prompt opens (the reply's text starts with it)."""


class PromptRenderer:
    """A request -> the prompt ids the engine generates from, extending the conversation's
    tokens where the request continues it."""

    def __init__(self, tokenizer: Any, tool_parser: str = "hermes") -> None:
        self.tokenizer, self.tool_parser = tokenizer, tool_parser
        self.vocab_size = len(tokenizer)
        self._renders_tools: dict[str, bool] = {}

    def prompt_ids(self, req: Request, conv: Conversation) -> Rendered:
        opening = ""
        if req.kind == "chat":
            ids = self._chat(req, conv)
            opening = self._opening(req)
            ids = ids + self._ids(opening)
        else:
            ids = self._completion(req, conv)
        if not ids:
            raise RequestError("the prompt renders to no tokens")
        if len(ids) > MAX_PROMPT_TOKENS:
            raise RequestError(f"the prompt has {len(ids)} tokens (at most {MAX_PROMPT_TOKENS})")
        return Rendered(ids, opening)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _opening(self, req: Request) -> str:
        if req.tool_choice not in ("required", "function"):
            return ""
        if self.tool_parser not in OPENINGS:
            raise RequestError(
                f"tool_choice {req.tool_choice!r} needs a tool-call format to open a call in; "
                f"env.tool_parser is {self.tool_parser!r}",
                "tool_choice",
            )
        return OPENINGS[self.tool_parser](req.tool_name)

    def _chat(self, req: Request, conv: Conversation) -> list[int]:
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise RequestError(
                "the policy's tokenizer has no chat template: use /v1/completions, or give the "
                "run one (model.chat_template)"
            )
        if req.tools:
            self._check_renders_tools(template)
        msgs, n = req.messages, len(conv.messages or ())
        if (
            conv.messages is not None
            and conv.reopen is not None
            and len(msgs) > n + 1
            and msgs[:n] == conv.messages
            and is_reply(msgs[n], conv.reply)
        ):
            try:
                text = continuation_text(self.tokenizer, _for_template(msgs[n + 1 :]), req.tools)
            except ValueError:
                text = None  # the template cannot render them alone: render the whole history
            if text is not None:
                return conv.tokens + self._ids(conv.reopen + text)
        return self._ids(self._render(_for_template(msgs), req.tools, True))

    def _render(self, msgs: list[dict[str, Any]], tools: list | None, generation: bool) -> str:
        try:
            extra = {"tools": tools} if tools else {}
            return self.tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=generation, **extra
            )
        except Exception as err:  # noqa: BLE001 - a template's own refusal, shown to the agent
            raise RequestError(
                f"the chat template refused the messages: {err}", "messages"
            ) from err

    def _check_renders_tools(self, template: str) -> None:
        """A template that renders the same with and without tools would hide them from the
        model: refused once per template, not per call."""
        if template not in self._renders_tools:
            probe = [{"role": "user", "content": "x"}]
            self._renders_tools[template] = self._render(probe, None, True) != self._render(
                probe, [_PROBE_TOOL], True
            )
        if not self._renders_tools[template]:
            name = getattr(self.tokenizer, "name_or_path", "") or "the policy's tokenizer"
            raise RequestError(
                f"the chat template of {name!r} ignores `tools`: the model would never see them. "
                "Give the run a template that renders tools (model.chat_template), or describe "
                "the tools in the messages",
                "tools",
            )

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

    def end_of_turn(self) -> str | None:
        """The template's end-of-turn text (the tokenizer's EOS), None when it has none."""
        return getattr(self.tokenizer, "eos_token", None) or None

    def stop_cut(
        self, sampled: Sequence[int], full: str, stops: Sequence[str]
    ) -> tuple[int, str] | None:
        """(k, text): the first `k` sampled ids are the fewest whose text holds a stop string;
        `text` is their text before the first stop string. None when no stop string occurs.
        `full` is the text of all of `sampled`."""
        if not stops or not any(s in full for s in stops):
            return None
        lo, hi = 1, len(sampled)  # the text of a longer prefix extends a shorter one's
        while lo < hi:
            mid = (lo + hi) // 2
            if any(s in self.text(sampled[:mid]) for s in stops):
                hi = mid
            else:
                lo = mid + 1
        text = self.text(sampled[:lo])
        return lo, text[: min(text.find(s) for s in stops if s in text)]


def _for_template(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: tool-call arguments as objects, not the JSON
    strings OpenAI sends (a template's `tojson` would encode the string again)."""
    out = []
    for m in msgs:
        calls = m.get("tool_calls")
        if isinstance(calls, list) and calls:
            m = {**m, "tool_calls": [_call_for_template(c) for c in calls]}
        out.append(m)
    return out


def _call_for_template(call: Any) -> Any:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def is_reply(message: Mapping[str, Any], reply: Mapping[str, Any] | None) -> bool:
    """`message` is the assistant reply the endpoint returned, as a framework sends it back:
    the same content (null and '' alike) and tool calls (same ids and names, arguments equal as
    JSON), any other key empty."""
    if reply is None or message.get("role") != "assistant":
        return False
    for key, value in message.items():
        if key not in ("role", "content", "tool_calls", "name") and value not in _EMPTY:
            return False
    if (message.get("content") or "") != (reply.get("content") or ""):
        return False
    sent, returned = message.get("tool_calls") or [], reply.get("tool_calls") or []
    return (
        isinstance(sent, list)
        and len(sent) == len(returned)
        and all(_same_call(a, b) for a, b in zip(sent, returned, strict=True))
    )


def _same_call(sent: Any, returned: Mapping[str, Any]) -> bool:
    if not isinstance(sent, Mapping) or sent.get("id") != returned["id"]:
        return False
    if sent.get("type", "function") != "function":
        return False
    fn, want = sent.get("function"), returned["function"]
    if not isinstance(fn, Mapping) or fn.get("name") != want["name"]:
        return False
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return False
    return args == json.loads(want["arguments"])


def remember(
    conv: Conversation,
    req: Request,
    prompt_ids: list[int],
    sampled: list[int],
    sampled_text: str,
    reply: dict[str, Any],
    reopen: str | None,
) -> None:
    """After a call: what the next call of the episode may extend. `sampled_text`: the text of
    the kept sampled ids; `reply`: the assistant message returned."""
    conv.tokens = list(prompt_ids) + list(sampled)
    conv.reopen = reopen
    if req.kind == "chat":
        conv.messages, conv.reply = req.messages, reply
        conv.text = None
    else:
        conv.messages = conv.reply = None
        conv.text = req.prompt + sampled_text if isinstance(req.prompt, str) else None


def response_body(
    req: Request,
    served_model: str,
    message: dict[str, Any],
    prompt_ids: list[int],
    sampled: list[int],
    logprobs: list[float],
    finish_reason: str,
    version: int,
    token_texts: list[str] | None,
) -> dict[str, Any]:
    """The OpenAI response body for one call; `relax` adds the exact ids and the version.
    `message`: the assistant message (chat) or {'content': text} (completion)."""
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
            "message": message,
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
        text = message["content"]
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
