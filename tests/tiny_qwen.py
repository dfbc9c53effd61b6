"""Tiny Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni and Qwen3-Omni-MoE policies built in code (no
download): the char tokenizer with the Qwen special tokens, a two-layer model of the family's
transformers class, and its media processor (8-px patches merged 2x2, images of 16x16 to 48x48
pixels, 16 kHz audio)."""

from __future__ import annotations

import torch
import transformers

from relax_core.models.tiny import build_char_tokenizer
from relax_core.multimodal.qwen import FAMILIES, QwenMediaProcessor, QwenPolicy, SpecialTokens

SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
AUDIO_SPECIALS = ("<|audio_start|>", "<|audio_end|>", "<|audio_pad|>")
ROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
TEXT = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, rope_parameters=ROPE,
)  # fmt: skip
VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=8,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
)  # fmt: skip
WINDOWED = dict(window_size=32, fullatt_block_indexes=[1])  # Qwen2.5 vision towers
DEEPSTACK = dict(num_position_embeddings=64, deepstack_visual_indexes=[0])  # Qwen3 towers
AUDIO = dict(
    num_mel_bins=32, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
    output_dim=64, max_source_positions=200,
)  # fmt: skip


def tiny_tokenizer(audio: bool):
    tok = build_char_tokenizer()
    specials = SPECIALS + (AUDIO_SPECIALS if audio else ())
    tok.add_special_tokens({"additional_special_tokens": list(specials)})
    return tok


def tiny_hf_model(kind: str, tok) -> torch.nn.Module:
    ids = {name: tok.convert_tokens_to_ids(name) for name in SPECIALS + AUDIO_SPECIALS}
    vision = {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }
    audio = {
        "audio_token_id": ids["<|audio_pad|>"],
        "audio_start_token_id": ids["<|audio_start|>"],
        "audio_end_token_id": ids["<|audio_end|>"],
        "position_id_per_seconds": 4,
    }
    text = {**TEXT, "vocab_size": len(tok), "pad_token_id": tok.pad_token_id}
    text.update(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    T = transformers
    if kind == "qwen2.5-vl":
        vis = {**VISION, **WINDOWED, "tokens_per_second": 2}
        config = T.Qwen2_5_VLConfig(text_config=text, vision_config=vis, **vision)
    elif kind == "qwen3-vl":
        config = T.Qwen3VLConfig(text_config=text, vision_config={**VISION, **DEEPSTACK}, **vision)
    elif kind == "qwen2.5-omni":
        config = T.Qwen2_5OmniThinkerConfig(
            text_config=text,
            vision_config={**VISION, **WINDOWED},
            audio_config={**AUDIO, "n_window": 8},
            **vision,
            **audio,
        )
    else:
        moe = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
        config = T.Qwen3OmniMoeThinkerConfig(
            text_config={**text, **moe},
            vision_config={**VISION, **DEEPSTACK},
            audio_config={**AUDIO, "n_window": 50, "downsample_hidden_size": 16},
            **vision,
            **audio,
        )
    cls = getattr(T, FAMILIES[kind].model_class)
    torch.manual_seed(0)
    return cls(config).eval()


def tiny_qwen_policy(kind: str) -> tuple[QwenPolicy, object]:
    family = FAMILIES[kind]
    tok = tiny_tokenizer("audio" in family.modalities)
    hf = tiny_hf_model(kind, tok)
    images = transformers.Qwen2VLImageProcessorPil(
        patch_size=8, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=48 * 48
    )
    features = None
    if "audio" in family.modalities:
        features = transformers.WhisperFeatureExtractor(
            feature_size=32, sampling_rate=16000, chunk_length=2
        )
    window = hf.config.audio_config.n_window if features is not None else 50
    processor = QwenMediaProcessor(
        family, SpecialTokens.of(hf.config, tok), images, features, tok, 4.0, window
    )
    return QwenPolicy(hf, processor), tok
