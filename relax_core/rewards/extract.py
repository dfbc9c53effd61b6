"""Pulling the final answer out of a free-form response (shared by the built-in rewards)."""

from __future__ import annotations

import re

_ANSWER_TAG = re.compile(r"answer\s*:", re.IGNORECASE)
_BOXED = "\\boxed{"
# Markdown emphasis around the tag ("**Answer:** 42") is not part of the answer.
_DECORATION = " \t*_"


def answer_line(response: str) -> str | None:
    """Text after the last `Answer:` (case-insensitive) up to the end of that line, or None if
    the response has no such tag."""
    matches = list(_ANSWER_TAG.finditer(response))
    if not matches:
        return None
    rest = response[matches[-1].end() :]
    return rest.split("\n", 1)[0].strip(_DECORATION)


def last_boxed(text: str) -> str | None:
    r"""Content of the last `\boxed{...}` in `text` (nested braces allowed), or None if there is
    none or its braces never close."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth = 1
    pos = start + len(_BOXED)
    for i in range(pos, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[pos:i].strip()
    return None


def final_answer(response: str) -> str:
    r"""The answer a response commits to: its `Answer:` line if it has one, else the whole
    stripped response; a `\boxed{...}` inside that is unwrapped."""
    line = answer_line(response)
    text = line if line is not None else response.strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text


def clip(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters, so `reward_info` stays small next to the response."""
    return text if len(text) <= limit else text[:limit] + "..."
