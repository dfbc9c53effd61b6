"""Prompt source for the rollout role: dataset rows + resumable cursor + tokenized prompt cache.

With `media` (an omni policy) a prompt starts with its media's placeholders and an item carries
the media's encoder inputs (services/media.py builds such sources)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_core.data.cursor import DatasetCursor, PromptSampler
from relax_core.data.templates import render_prompt


@dataclass(frozen=True)
class PromptItem:
    epoch: int
    prompt_index: int
    row: dict[str, Any]
    prompt_ids: list[int]
    media: list | None = None
    """Encoder inputs of the row's media (an omni policy), in order; None for text."""


@dataclass(frozen=True)
class PromptMedia:
    """How an omni policy sees a row's media: placeholders in the prompt, encoder inputs."""

    resolver: Any
    """multimodal.inputs.MediaResolver."""
    spec: Any
    """models.omni.OmniSpec."""
    media_token_id: int


class PromptSource:
    """Hands out the next prompts of the dataset in a deterministic, resumable order."""

    def __init__(
        self,
        rows: list[dict[str, Any]],
        tokenizer: Any,
        template: str,
        system_prompt: str,
        seed: int,
        shuffle: bool,
        media: PromptMedia | None = None,
    ) -> None:
        self.rows = rows
        self.media = media
        self.tokenizer = tokenizer
        self.template = template
        self.system_prompt = system_prompt or None
        self.sampler = PromptSampler(len(rows), seed=seed, shuffle=shuffle)
        self._ids: dict[int, list[int]] = {}

    def prompt_ids(self, index: int) -> list[int]:
        if index not in self._ids:
            text = render_prompt(
                self.rows[index]["prompt"], self.template, self.tokenizer, self.system_prompt
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if self.media is not None:
                from relax_core.models.omni import media_placeholders

                m = self.media
                ids = media_placeholders(self.rows[index], m.spec, m.media_token_id) + ids
            self._ids[index] = ids
        return self._ids[index]

    def media_inputs(self, index: int) -> list | None:
        """Encoder inputs of row `index`'s media (decoded once, cached by the resolver)."""
        if self.media is None:
            return None
        return self.media.resolver.inputs(self.rows[index].get("media"))

    def take(self, cursor: DatasetCursor, n: int) -> tuple[list[PromptItem], DatasetCursor]:
        picks, cursor = self.sampler.take(cursor, n)
        items = [
            PromptItem(e, i, self.rows[i], self.prompt_ids(i), self.media_inputs(i))
            for e, i in picks
        ]
        return items, cursor

    def at(self, first: int, n: int) -> list[PromptItem]:
        """The `n` prompts from global position `first` of the dataset stream (position p is
        prompt p % size of epoch p // size's order), as async rollout tickets number them."""
        size = self.sampler.num_prompts
        return self.take(DatasetCursor(epoch=first // size, index=first % size), n)[0]
