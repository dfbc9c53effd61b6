"""Where a multimodal policy's media sit in its text: placeholder tokens, and the encoder inputs
that fill them.

A prompt (data/prompts.py) or an env observation (rollout/observations.py) that shows media
holds, where it shows them, the placeholder tokens the policy writes its encoded media over:
- `OmniPlaceholders` (models/omni.py): `spec.tokens_for(kind)` `<media>` tokens per medium;
- `QwenPlaceholders` (multimodal/qwen): per medium its start token, as many placeholders as the
  processed medium takes (QwenMedia.tokens; a Qwen3-VL video: one run per temporal patch, each
  after its timestamp text) and its end token, the layout QwenPolicy finds its media by.
Both read media references through a MediaResolver (inputs.py), so a medium is decoded once for
its placeholder count and its encoder input.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from relax_core.multimodal.inputs import MediaResolver


class MediaPlaceholders(Protocol):
    """How a multimodal policy takes media references in its text."""

    resolver: MediaResolver

    def placeholder_ids(self, items: Sequence[Mapping[str, Any]]) -> list[int]:
        """The token ids the items take in the text, in order (MediaError for a bad item)."""
        ...

    def inputs(self, items: Sequence[Mapping[str, Any]] | None) -> list:
        """The items' encoder inputs, in order (what the engine's `media=` carries)."""
        ...


class OmniPlaceholders:
    """MediaPlaceholders of the tiny omni policy: `spec.tokens_for(kind)` `<media>` tokens."""

    def __init__(self, resolver: MediaResolver, spec: Any, media_token_id: int) -> None:
        self.resolver, self.spec, self.media_token_id = resolver, spec, media_token_id

    def placeholder_ids(self, items: Sequence[Mapping[str, Any]]) -> list[int]:
        return [self.media_token_id] * sum(self.spec.tokens_for(item["kind"]) for item in items)

    def inputs(self, items: Sequence[Mapping[str, Any]] | None) -> list:
        return self.resolver.inputs(items)


class QwenPlaceholders:
    """MediaPlaceholders of a Qwen multimodal policy: each medium wrapped in its start and end
    tokens around the runs of placeholders its processed input fills."""

    def __init__(self, resolver: MediaResolver) -> None:
        self.resolver = resolver
        """Its encoding is the policy's multimodal.qwen.QwenMediaProcessor."""

    def placeholder_ids(self, items: Sequence[Mapping[str, Any]]) -> list[int]:
        return self.resolver.encoding.media_prompt_ids([], self.resolver.inputs(items))

    def inputs(self, items: Sequence[Mapping[str, Any]] | None) -> list:
        return self.resolver.inputs(items)
