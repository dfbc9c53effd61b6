"""Attention in float32 inside a policy whose linear layers compute in bfloat16
(`model.matmul_dtype`, precision.py).

Under autocast transformers' SDPA attention would run in bfloat16; this implementation runs it
on float32 copies of the queries, keys and values, outside autocast, and returns the input
dtype. Besides keeping the residual stream's numerics float32, it is the faster kernel on a CPU
with AVX512-BF16 but no AMX: torch's bf16 SDPA kernels are slower there than its float32 ones
(SmolLM2-135M: a decode step's attention 1.2-1.6 ms against 0.25 ms a layer, the training
backward ~1.5x), while its bf16 matmuls run about twice as fast as float32 ones. It is
registered under its own name through transformers' documented extension points
(AttentionInterface, AttentionMaskInterface with SDPA's mask); `use_float32_attention` switches
a policy to it.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

FLOAT32_SDPA = "sdpa_float32"
"""The attention implementation's name in a policy's config (`_attn_implementation`)."""


def sdpa_float32(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention computed in float32; the output in `query`'s dtype.
    query [B, H, Q, D], key/value [B, H_kv, K, D], as transformers passes them."""
    dtype = query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


AttentionInterface.register(FLOAT32_SDPA, sdpa_float32)
AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)


def use_float32_attention(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers model, or a PEFT model around one) to float32 attention."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(base, PreTrainedModel):
        raise TypeError(
            f"model.matmul_dtype: {type(base).__name__} is not a transformers model, whose "
            "attention implementation this sets; use it with a text policy"
        )
    base.set_attn_implementation(FLOAT32_SDPA)
