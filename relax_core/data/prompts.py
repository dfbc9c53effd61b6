"""Prompt source for the rollout role: dataset rows + resumable cursor + tokenized prompt cache.

With `media` (a multimodal policy; multimodal/placeholders.py) a prompt shows its row's media at
the start of the user's message: the policy's placeholder tokens go where the prompt text starts
(the 'plain' template: the very start; 'chat': after the template's user-turn header), and an
item carries the media's encoder inputs. roles/media.py builds such sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax_core.data.cursor import DatasetCursor, PromptSampler
from relax_core.data.templates import render_prompt
from relax_core.multimodal.placeholders import MediaPlaceholders

# Marks where the prompt text starts in the rendered template; the text is split there before
# tokenizing, so the marker itself never becomes tokens.
_MEDIA_MARK = "\x00relax-media\x00"


@dataclass(frozen=True)
class PromptItem:
    epoch: int
    prompt_index: int
    row: dict[str, Any]
    prompt_ids: list[int]
    media: list | None = None
    """Encoder inputs of the row's media (a multimodal policy), in order; None for text."""


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
        media: MediaPlaceholders | None = None,
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
            row = self.rows[index]
            if self.media is None or not row.get("media"):
                ids = self._tokens(self._render(row["prompt"]))
            else:
                if _MEDIA_MARK in row["prompt"]:
                    raise ValueError(f"prompt {index} contains a reserved marker")
                before, after = self._render(_MEDIA_MARK + row["prompt"]).split(_MEDIA_MARK)
                media = self.media.placeholder_ids(row["media"])
                ids = self._tokens(before) + media + self._tokens(after)
            self._ids[index] = ids
        return self._ids[index]

    def _render(self, prompt: str) -> str:
        return render_prompt(prompt, self.template, self.tokenizer, self.system_prompt)

    def _tokens(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def media_inputs(self, index: int) -> list | None:
        """Encoder inputs of row `index`'s media (decoded once, cached by the resolver)."""
        if self.media is None:
            return None
        return self.media.inputs(self.rows[index].get("media"))

    def _tokenize_text_prompts(self, indices: list[int]) -> None:
        """Token ids of the text-only rows among `indices` not seen yet, in one tokenizer call
        (what prompt_ids would give each; the batch call costs a fraction of one per row)."""
        todo = [
            i
            for i in dict.fromkeys(indices)
            if i not in self._ids and (self.media is None or not self.rows[i].get("media"))
        ]
        texts = [self._render(self.rows[i]["prompt"]) for i in todo]
        todo = [i for i, text in zip(todo, texts, strict=True) if text]
        texts = [text for text in texts if text]
        if len(todo) < 2:
            return
        encoded = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        for i, ids in zip(todo, encoded, strict=True):
            self._ids[i] = list(ids)

    def take(self, cursor: DatasetCursor, n: int) -> tuple[list[PromptItem], DatasetCursor]:
        picks, cursor = self.sampler.take(cursor, n)
        self._tokenize_text_prompts([i for _, i in picks])
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
