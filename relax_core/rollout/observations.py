"""Rendering an env's observation message into the token ids appended after a model turn.

Two formats, as for prompts (data/templates.py):
- "plain": the fixed text "\\n{role}: {content}\\n" (e.g. "\\ntool: 5535\\n"), for base models and
  the tiny char tokenizer, which knows no angle brackets;
- "chat": the tokenizer's chat template. A template renders whole conversations, so the
  observation's text is the difference between an anchor conversation with and without the
  message (generation prompt included, so the next assistant turn is opened), preceded by what
  the template writes after an end-of-turn token (e.g. Qwen's "\\n" after "<|im_end|>"): the
  model's turn ended with that token, and the observation continues from it.

Media (an env that shows an image): the message's `media` items get the policy's placeholder
tokens at the start of its content (multimodal/placeholders.py), and their encoder inputs go with
the episode's next model turns. A text policy cannot see media: rendering such a message raises ValueError, which ends
that episode as an env error.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_core.data.templates import TEMPLATES
from relax_core.multimodal.placeholders import MediaPlaceholders

PLAIN_FORMAT = "\n{role}: {content}\n"
# Marks where media placeholders go; the text is split there before tokenizing, so the marker
# itself never becomes tokens.
_MEDIA_MARK = "\x00relax-media\x00"
# Conversations the observation is rendered after. A system message first: templates that
# render an assistant turn differently once it is no longer last (Qwen3's think block) would
# otherwise break the prefix property. The second serves templates that refuse a system role;
# the third, templates that refuse a conversation without a user turn (Qwen3 raises "No user
# query found in messages.") when the new messages are tool results.
_ANCHORS: tuple[tuple[dict[str, str], ...], ...] = (
    ({"role": "system", "content": "x"},),
    ({"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}),
    ({"role": "user", "content": "x"},),
)


@dataclass(frozen=True)
class RenderedObservation:
    ids: list[int]
    """Token ids to append to the episode (loss_mask 0)."""
    media: list[dict[str, Any]] = field(default_factory=list)
    """The message's media as row-schema items {kind, uri, bytes}, in placeholder order."""
    media_inputs: list = field(default_factory=list)
    """Their encoder inputs, in the same order."""


class ObservationRenderer:
    """Observation message -> token ids, in the run's prompt template ('plain' or 'chat')."""

    def __init__(
        self, tokenizer: Any, template: str = "plain", media: MediaPlaceholders | None = None
    ) -> None:
        if template not in TEMPLATES:
            raise ValueError(f"unknown prompt template {template!r}; choose one of {TEMPLATES}")
        if template == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                "use prompt template 'plain' for multi-turn episodes"
            )
        self.tokenizer, self.template, self.media = tokenizer, template, media

    def __call__(self, message: Any) -> RenderedObservation:
        role, content, items = _check_message(message)
        if not items:
            return RenderedObservation(self._ids(self._text(role, content)))
        media = self.media
        if media is None:
            raise ValueError(
                f"the observation has {len(items)} media item(s) but the policy takes text only"
            )
        before, after = self._text(role, _MEDIA_MARK + content).split(_MEDIA_MARK)
        ids = self._ids(before) + media.placeholder_ids(items) + self._ids(after)
        return RenderedObservation(ids, items, media.inputs(items))

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def _text(self, role: str, content: str) -> str:
        if self.template == "plain":
            return PLAIN_FORMAT.format(role=role, content=content)
        text = continuation_text(self.tokenizer, [{"role": role, "content": content}])
        if text.count(_MEDIA_MARK) != content.count(_MEDIA_MARK):
            raise ValueError(
                f"the chat template of {getattr(self.tokenizer, 'name_or_path', '')!r} does not "
                f"render the content of a {role!r} message as it is"
            )
        return text


def continuation_text(
    tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: list | None = None
) -> str:
    """The chat-template text that `messages` add after a conversation whose last turn ended on
    the tokenizer's end-of-turn token, ending with the generation prompt of the next assistant
    turn: the difference between an anchor conversation rendered with and without them,
    preceded by what the template writes after an end-of-turn token (e.g. Qwen's "\\n" after
    "<|im_end|>"). Raises ValueError when the template renders no such difference."""
    problems = []
    for anchor in _ANCHORS:
        try:
            before = _apply(tokenizer, list(anchor), False, tools)
            after = _apply(tokenizer, [*anchor, *messages], True, tools)
        except Exception as err:  # noqa: BLE001 - a template may refuse a role; try the next
            problems.append(f"{type(err).__name__}: {err}")
            continue
        if after.startswith(before):
            return _turn_separator(tokenizer, before) + after[len(before) :]
        problems.append("the rendered conversation does not extend its prefix")
    roles = " + ".join(f"a {m.get('role')!r} message" for m in messages)
    raise ValueError(
        f"the chat template of {getattr(tokenizer, 'name_or_path', '')!r} cannot render "
        f"{roles} after a conversation ({'; '.join(problems)})"
    )


def _apply(tokenizer: Any, messages: list, generation: bool, tools: list | None) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **extra
    )


def _turn_separator(tokenizer: Any, rendered: str) -> str:
    eos = getattr(tokenizer, "eos_token", None)
    if not eos or eos not in rendered:
        return ""
    return rendered[rendered.rfind(eos) + len(eos) :]


def _check_message(message: Any) -> tuple[str, str, list[dict[str, Any]]]:
    if not isinstance(message, Mapping):
        raise TypeError(
            f"format_observation must return a message dict, got {type(message).__name__}"
        )
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str) or not role or not isinstance(content, str):
        raise ValueError(
            "format_observation must return {'role': str, 'content': str}, got "
            f"role {role!r} and content of type {type(content).__name__}"
        )
    if _MEDIA_MARK in content:
        raise ValueError("observation content contains a reserved marker")
    items = []
    for item in message.get("media") or []:
        if not isinstance(item, Mapping) or not item.get("kind"):
            raise ValueError(f"observation media items need a 'kind', got {item!r}")
        if not item.get("uri") and not item.get("bytes"):
            raise ValueError(f"observation media item {item.get('kind')!r} has no uri or bytes")
        items.append(
            {"kind": item["kind"], "uri": item.get("uri") or "", "bytes": item.get("bytes")}
        )
    return role, content, items
