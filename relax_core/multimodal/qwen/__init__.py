"""Qwen2.5-VL, Qwen3-VL and the Qwen Omni thinkers from transformers as policies of the torch
engine and backend: the family table (families.py), media -> model inputs and placeholder
expansion (processing.py), and the model adapter with M-RoPE positions (policy.py)."""

from relax_core.multimodal.qwen.families import FAMILIES, Family, family_of
from relax_core.multimodal.qwen.policy import QwenPolicy, load_qwen_policy
from relax_core.multimodal.qwen.processing import QwenMedia, QwenMediaProcessor, SpecialTokens

__all__ = [
    "FAMILIES",
    "Family",
    "QwenMedia",
    "QwenMediaProcessor",
    "QwenPolicy",
    "SpecialTokens",
    "family_of",
    "load_qwen_policy",
]
