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

Grouped-query attention with a mask (a training forward over padded rows, a prefill of prompts
of several lengths) runs as one SDPA call with `enable_gqa`: transformers' SDPA path repeats
each key/value head for its query heads there (a copy per layer forward, and in the backward a
sum over the copies), which torch's CPU kernels do not need. The same products in the same
order: outputs and gradients equal the repeated heads' bit for bit (tests/unit/test_matmul_dtype.py),
and a training step of the CPU default spends ~3 ms less in attention. Small masked calls on a
CPU skip SDPA for two batched matrix products (`SMALL_ATTENTION`), equal to float32 rounding.

It also reads a packed training forward (`packed=PackedResponses` among the attention
arguments, train/shared_prompts.py): the layers around it ran the distinct prompts' and the rows'
real tokens as one row, and the attention lays them out padded, each response after its
prompt's keys and values, and back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F
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
    packed = kwargs.pop("packed", None)
    if packed is not None:
        return _packed_attention(module, query, key, value, packed, kwargs), None
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(query.device.type, enabled=False):
        if _decode_step(query, key, attention_mask, kwargs):
            return _decode_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
        if _grouped_with_mask(module, query, key, attention_mask, kwargs):
            out = _attend(query, key, value, attention_mask, kwargs)  # one SDPA call, enable_gqa
            return out.transpose(1, 2).contiguous().to(dtype), None
        out, weights = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), attention_mask, **kwargs
        )
    return out.to(dtype), weights


@dataclass(frozen=True)
class PackedPrompts:
    """The distinct prompts of a shared-prompt micro-batch run at the head of the packed row,
    in the same pass as the responses (train/shared_prompts.py): their real tokens packed, laid
    out left-padded [G, P] inside attention only."""

    index: torch.Tensor
    """[M] each packed prompt token's place in the left-padded [G * P] layout, ascending."""
    count: int
    """G, the distinct prompts."""
    width: int
    """P, the longest prompt."""
    mask: torch.Tensor
    """[G, 1, P, P] bool: causal over the prompt's real tokens (a padding query sees itself)."""

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, M + ..., D] packed -> [G, H, P, D], zeros at padding."""
        return _padded(x, 0, self.index, self.count, self.width)


@dataclass(frozen=True)
class PackedResponses:
    """A shared-prompt micro-batch's training forward as one packed row (train/shared_prompts.py):
    the distinct prompts' real tokens, then the B rows' real response inputs (N), so that every
    linear layer, norm and MLP runs once over real tokens only. Attention alone lays them out
    padded: the prompts [G, P] (`prompts`), the responses [B, W] after their row's prompt.
    """

    prompts: PackedPrompts
    row: torch.Tensor
    """[B] the prompt each row continues."""
    index: torch.Tensor
    """[N] each packed response token's place in the padded [B * W] layout, ascending."""
    width: int
    """W: the longest row's input tokens."""
    tokens: int
    """N, the real response tokens; the packed row may hold more after them (a shape oneDNN has
    seen), whose attention output is zero."""
    mask: torch.Tensor
    """[B, 1, W, P + W] bool: the prompt's real tokens and the row's inputs up to the query's."""

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """[1, H, M + N + ..., D] packed -> [B, H, W, D] responses, zeros at padding."""
        start = self.prompts.index.numel()
        return _padded(x, start, self.index, self.row.shape[0], self.width)


def _padded(x: torch.Tensor, start: int, index: torch.Tensor, rows: int, width: int):
    """The packed tokens x[0, :, start : start + len(index)] ([1, H, L, D]) laid out [rows, H,
    width, D] at `index` of the [rows * width] layout, zeros elsewhere."""
    _, heads, _, dim = x.shape
    flat = x[0, :, start : start + index.numel()].transpose(0, 1)  # [n, H, D]
    out = flat.new_zeros(rows * width, heads, dim).index_copy(0, index, flat)
    return out.view(rows, width, heads, dim).transpose(1, 2)


def _packed(out: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[rows, H, width, D] attention output -> [n, H, D] at `index` of the [rows * width] layout."""
    rows, heads, width, dim = out.shape
    return out.transpose(1, 2).reshape(rows * width, heads, dim).index_select(0, index)


SMALL_ATTENTION = 512
"""Query positions x keys up to which `_attend` computes a masked attention as two batched
matrix products (`_small_attention`) instead of torch's CPU SDPA kernel, which runs every (row,
head) as its own task: the CPU default's training forward and backward over 256 rows of ~4
response queries and ~11 keys took 9.0 ms a layer that way against 5.1 (2 cores, float32);
even at 896 the two tie, and at 2944 (32 queries over 92 keys) SDPA is 1.4x faster."""


def _attend(query, keys, values, mask, kwargs) -> torch.Tensor:
    """Float32 attention of [R, H, Q, D] queries over [R, H_kv, K, D] keys and values."""
    dropout, scale = kwargs.get("dropout", 0.0), kwargs.get("scaling")
    with torch.autocast(query.device.type, enabled=False):
        query, keys, values = query.float(), keys.float(), values.float()
        if not dropout and _small(query, keys, mask):
            return _small_attention(query, keys, values, mask, scale)
        return F.scaled_dot_product_attention(
            query,
            keys,
            values,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scale,
            enable_gqa=query.shape[1] != keys.shape[1],
        )


def _small(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether `_small_attention` computes this call: on a CPU, a bool mask shared by a row's
    heads ([R or 1, 1, Q or 1, K]) that leaves every query a key (SDPA answers a query with
    none by zeros), and at most SMALL_ATTENTION query positions x keys."""
    return (
        query.device.type == "cpu"
        and query.shape[2] * keys.shape[2] <= SMALL_ATTENTION
        and query.shape[1] % keys.shape[1] == 0
        and keys.shape[-1] == query.shape[-1]
        and mask is not None
        and mask.dtype == torch.bool
        and mask.dim() == 4
        and mask.shape[1] == 1
        and bool(mask.any(-1).all())
    )


def _small_attention(query, keys, values, mask, scale: float | None) -> torch.Tensor:
    """SDPA's result for `_small` calls (to float32 rounding, gradients too): the query heads of
    a key/value head stacked, so both products are one batched matmul over (row, key head)."""
    rows, heads, width, dim = query.shape
    kv_heads = keys.shape[1]
    stacked = query.reshape(rows, kv_heads, heads // kv_heads * width, dim)
    scores = torch.matmul(stacked, keys.transpose(-1, -2)) * (dim**-0.5 if scale is None else scale)
    shape = scores.shape
    scores = scores.view(rows, kv_heads, heads // kv_heads, width, -1)
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf")).view(shape)
    return torch.matmul(scores.softmax(-1), values).view(rows, heads, width, values.shape[-1])


def _packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: PackedResponses,
    kwargs: dict,
) -> torch.Tensor:
    """[1, L, H, D] for the packed row of L: float32 attention of its prompt tokens over their
    prompt and of its N response queries over their row's prompt and inputs, as padded passes
    compute it for each, and zeros after them."""
    p = packed.prompts
    prompt_keys, prompt_values = p.padded(key), p.padded(value)
    prompts = _packed(_attend(p.padded(query), prompt_keys, prompt_values, p.mask, kwargs), p.index)
    keys = torch.cat([prompt_keys.index_select(0, packed.row), packed.padded(key)], 2)
    values = torch.cat([prompt_values.index_select(0, packed.row), packed.padded(value)], 2)
    flat = _packed(_attend(packed.padded(query), keys, values, packed.mask, kwargs), packed.index)
    extra = flat.new_zeros(key.shape[2] - prompts.shape[0] - packed.tokens, *flat.shape[1:])
    return torch.cat([prompts, flat, extra]).unsqueeze(0).to(query.dtype)


def _decode_step(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict
) -> bool:
    """Whether this call is a generation step on the CPU: one query position per row, no
    gradient, and nothing beyond dropout (off) and scale that `_decode_attention` would drop."""
    rows, _, positions, dim = query.shape
    return (
        positions == 1
        and query.device.type == "cpu"
        and not torch.is_grad_enabled()
        and query.shape[1] % key.shape[1] == 0
        and key.shape[-1] == dim
        and not kwargs.get("dropout")
        and all(kwargs.get(name) is None for name in _SDPA_EXTRAS)
        and (
            attention_mask is None
            or attention_mask.shape in ((rows, 1, 1, key.shape[2]), (1, 1, 1, key.shape[2]))
        )
    )


def _decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """A generation step's attention in float32, [B, 1, H, D] in `query`'s dtype, from query
    [B, H, 1, D] and the cache's keys/values [B, H_kv, K, D].

    torch's CPU SDPA kernels run each (row, head) as its own small task: at a decode step of
    the CPU default (256 rows, 12 heads, ~8 keys) that is ~1.1 ms a layer for ~1 MFLOP. Here the
    two products are batched matmuls over (row, key head) with the query heads of a group
    stacked, and the softmax runs over the keys laid outermost, so that every reduction is one
    vectorized pass over all rows: ~0.55 ms. Equal to SDPA to float32 rounding (~1e-6,
    tests/unit/test_decode_attention.py), and a row whose keys are all masked gets zeros, as
    SDPA's CPU kernel gives it.
    """
    rows, heads, _, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    scale = dim**-0.5 if scale is None else scale
    q = query.float().reshape(rows, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.float().transpose(-1, -2))  # [B, H_kv, G, K]
    scores.mul_(scale)
    if attention_mask is not None:
        mask = attention_mask.reshape(-1, 1, 1, length)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask)
    keys_first = scores.permute(3, 0, 1, 2).contiguous()  # [K, B, H_kv, G]
    top = keys_first.amax(0)
    top.masked_fill_(top == float("-inf"), 0.0)  # a row with every key masked
    weights = keys_first.sub_(top).exp_()
    total = weights.sum(0)
    weights.div_(total.masked_fill_(total == 0, 1.0))
    out = torch.matmul(weights.permute(1, 2, 3, 0), value.float())  # [B, H_kv, G, D]
    return out.reshape(rows, 1, heads, dim).to(query.dtype)


_SDPA_EXTRAS = ("softcap", "position_bias", "cache", "is_causal", "s_aux")
"""Arguments of transformers' SDPA path that change what it computes beyond dropout and scale
(a sliding window is in the mask already): a call with any of them set goes that way."""


def _grouped_with_mask(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    attention_mask: torch.Tensor | None,
    kwargs: dict,
) -> bool:
    """Whether this call is grouped-query attention over several query positions with a mask,
    on the CPU, with no other extra than dropout and scale: the case transformers answers by
    repeating key/value heads. Without a mask it passes `enable_gqa` itself; a single query
    position it packs into the heads."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (
        groups > 1
        and query.device.type == "cpu"
        and query.shape[2] > 1
        and attention_mask is not None
        and key.shape[-1] == query.shape[-1]
        and all(kwargs.get(name) is None for name in _SDPA_EXTRAS)
    )


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
