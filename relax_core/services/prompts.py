"""Prompt source for the rollout role: dataset rows + resumable cursor + tokenized prompt cache."""

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
    ) -> None:
        self.rows = rows
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
            self._ids[index] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._ids[index]

    def take(self, cursor: DatasetCursor, n: int) -> tuple[list[PromptItem], DatasetCursor]:
        picks, cursor = self.sampler.take(cursor, n)
        items = [PromptItem(e, i, self.rows[i], self.prompt_ids(i)) for e, i in picks]
        return items, cursor

    def at(self, first: int, n: int) -> list[PromptItem]:
        """The `n` prompts from global position `first` of the dataset stream (position p is
        prompt p % size of epoch p // size's order), as async rollout tickets number them."""
        size = self.sampler.num_prompts
        return self.take(DatasetCursor(epoch=first // size, index=first % size), n)[0]
