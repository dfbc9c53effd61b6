"""What differs between the Qwen multimodal families in transformers, in one table.

The adapter (policy.py) and the media processing (processing.py) are written once; a `Family`
names what they must do differently for Qwen2.5-VL, Qwen3-VL, the Qwen2.5-Omni thinker and the
Qwen3-Omni-MoE thinker: the transformers class, the media kinds it reads, whether video frames
are separated by timestamp text (Qwen3-VL), whether vision features also enter early decoder
layers (DeepStack: Qwen3-VL, Qwen3-Omni), how its `get_rope_index` is called, and how many
tokens an audio clip of n feature frames takes (each Omni processor's own rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from relax_core.config.checks import MODALITIES


def _qwen25_omni_audio_tokens(feature_frames: int, n_window: int) -> int:
    del n_window  # Qwen2.5-Omni's count does not depend on the encoder's window
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        _get_feat_extract_output_lengths,
    )

    return int(_get_feat_extract_output_lengths(torch.tensor(feature_frames)))


def _qwen3_omni_audio_tokens(feature_frames: int, n_window: int) -> int:
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    return int(_get_feat_extract_output_lengths(torch.tensor(feature_frames), n_window))


@dataclass(frozen=True)
class Family:
    kind: str
    """The `model.kind` of run configs (config/checks.py MODEL_KINDS)."""
    model_class: str
    """The transformers class of the policy (a thinker for the Omni models: text out only)."""
    model_types: tuple[str, ...]
    """`config.json` model_type values this family loads (a full Omni checkpoint included)."""
    modalities: tuple[str, ...]
    """Media kinds the model reads (config/checks.py MODALITIES: known without importing torch)."""
    rope: str
    """'token_types': get_rope_index reads mm_token_type_ids (VL); 'omni': it scans token ids."""
    frame_timestamps: bool = False
    """Each temporal patch of a video is its own run of placeholders, after '<t seconds>' text."""
    deepstack: bool = False
    """Vision features are also added to the hidden states of the first decoder layers."""
    audio_tokens: Callable[..., int] | None = None
    """Placeholders an audio clip of n log-mel frames takes, given the audio encoder's window
    (`audio_config.n_window`): the processor's own rule."""


FAMILIES = {
    f.kind: f
    for f in (
        Family(
            "qwen2.5-vl",
            "Qwen2_5_VLForConditionalGeneration",
            ("qwen2_5_vl",),
            MODALITIES["qwen2.5-vl"],
            rope="token_types",
        ),
        Family(
            "qwen3-vl",
            "Qwen3VLForConditionalGeneration",
            ("qwen3_vl",),
            MODALITIES["qwen3-vl"],
            rope="token_types",
            frame_timestamps=True,
            deepstack=True,
        ),
        Family(
            "qwen2.5-omni",
            "Qwen2_5OmniThinkerForConditionalGeneration",
            ("qwen2_5_omni", "qwen2_5_omni_thinker"),
            MODALITIES["qwen2.5-omni"],
            rope="omni",
            audio_tokens=_qwen25_omni_audio_tokens,
        ),
        Family(
            "qwen3-omni",
            "Qwen3OmniMoeThinkerForConditionalGeneration",
            ("qwen3_omni_moe", "qwen3_omni_moe_thinker"),
            MODALITIES["qwen3-omni"],
            rope="omni",
            deepstack=True,
            audio_tokens=_qwen3_omni_audio_tokens,
        ),
    )
}


def family_of(kind: str) -> Family:
    if kind not in FAMILIES:
        raise ValueError(
            f"model.kind {kind!r} is not a Qwen multimodal kind ({', '.join(FAMILIES)})"
        )
    return FAMILIES[kind]


def family_for_model_type(model_type: str) -> Family | None:
    """The family whose checkpoints have this config.json model_type; None for other models."""
    for family in FAMILIES.values():
        if model_type in family.model_types:
            return family
    return None


def model_class(family: Family) -> type:
    import transformers

    return getattr(transformers, family.model_class)


def family_of_model(model: torch.nn.Module) -> Family:
    for family in FAMILIES.values():
        if type(model).__name__ == family.model_class:
            return family
    names = ", ".join(f.model_class for f in FAMILIES.values())
    raise TypeError(f"{type(model).__name__} is not a supported Qwen multimodal model ({names})")
