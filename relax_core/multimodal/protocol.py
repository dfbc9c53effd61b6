"""What a multimodal policy offers beyond token embeddings, for the torch engine and backend.

The tiny omni policy (models/omni.py) needs only `embed`: its media take the place of
placeholder embeddings and positions count tokens. A policy with multimodal rotary positions
(M-RoPE: Qwen2.5-VL, Qwen3-VL, the Qwen Omni thinkers; multimodal/qwen/) also places its media
in position space, and some add vision features inside the decoder; such a policy implements
`MultimodalDecoder`, and the engine and backend ask it for positions and decoder inputs.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class MultimodalDecoder(Protocol):
    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: list[list[Any]]
    ) -> torch.Tensor:
        """Positions [3, B, T] of a padded batch whose rows carry `media` (pads: 0). A token
        after the last medium of its row is one past the token before it, so the next position
        of a decode step is the last one + 1."""
        ...

    def decoder_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        media: list[list[Any]],
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Keyword inputs of `get_decoder()` (inputs_embeds, position_ids, and whatever else
        the decoder takes for media) for a padded batch whose rows carry `media`."""
        ...
