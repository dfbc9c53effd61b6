"""The training forward over rows that repeat their prompt (a GRPO group's samples): each
distinct prompt runs once, its keys and values serve every row continuing it, and the responses
run on top.

Responses differ in length, so a padded [B, W] response pass computes the longest row's width for
every row: a sixth to a third of the CPU default's response tokens were padding (256 rows of 2.5
inputs on average, padded to 3 or 4), SmolLM2-135M's 30% (16 rows of 3-32 tokens). With the
float32 attention of `model.matmul_dtype` (models/attention.py) the response pass runs packed
instead: the real input tokens as one row through every linear layer, norm and MLP; only
attention lays them out padded after their prompt. Each real token sees the same keys and values
under the same mask as in the padded pass, so the log-probs are the padded pass's bit for bit;
gradients differ in rounding (the weight gradients sum the tokens in another grouping).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from relax_core.models.attention import FLOAT32_SDPA, PackedResponses
from relax_core.models.precision import bucket_length
from relax_core.train.batch import MicroBatch, SharedPrompts


def shared_prompt_hidden(model: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """[B, R, d] hidden states predicting each response token, each distinct prompt run once.

    The prompts' forward fills a KV cache whose rows are then taken for every row continuing
    them (differentiably: each row's gradient flows back into its prompt's keys and values).
    Response token 0 is predicted by the prompt's last hidden state, token t by the response's
    token t - 1.
    """
    sp = mb.shared
    assert sp is not None
    decoder = model.get_decoder()
    cache = DynamicCache()
    ids, mask = _bucketed_prompts(sp.ids, sp.mask)
    prompt = decoder(
        input_ids=ids,
        attention_mask=mask,
        position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    # Rows are taken with index_select, not advanced indexing (`x[rows]`, as in transformers'
    # Cache.batch_select_indices): the backward of advanced indexing on the CPU is index_put_
    # with accumulate=True, which adds a prompt's rows with atomic adds from several threads in
    # a varying order, so the same step gave different gradients run to run. index_select's
    # backward (index_add_) adds them in index order.
    first = prompt[:, -1].index_select(0, sp.row)  # left-padded: the last column is real
    width = mb.response_ids.shape[1]
    if width == 1:
        return first.unsqueeze(1)
    if _packs(decoder, cache):
        return _packed_responses(decoder, mb, sp, cache, first)
    _select_rows(cache, sp.row)
    prompt_len = sp.mask.sum(-1)[sp.row]
    steps = torch.arange(width - 1, device=prompt_len.device)
    rest = decoder(
        input_ids=mb.response_ids[:, :-1],
        attention_mask=torch.cat([sp.mask[sp.row], sp.response_mask[:, :-1]], dim=-1),
        position_ids=prompt_len.unsqueeze(1) + steps,
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    return torch.cat([first.unsqueeze(1), rest], dim=1)


def _bucketed_prompts(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On a CPU, the distinct prompts [P, L] with the last one repeated up to
    `bucket_length(P)` rows: P x L is the prompt pass's matrix dimension, and P varies from step
    to step once groups without signal stay out of training (train/inert.py), each new one a
    oneDNN compile. No row continues a repeat, so it adds nothing to any gradient."""
    n = ids.shape[0]
    if ids.device.type != "cpu" or bucket_length(n) == n:
        return ids, mask
    repeat = torch.full((bucket_length(n) - n,), n - 1, dtype=torch.long, device=ids.device)
    every = torch.cat([torch.arange(n, device=ids.device), repeat])
    return ids.index_select(0, every), mask.index_select(0, every)


def _packs(decoder: torch.nn.Module, cache: DynamicCache) -> bool:
    """Whether the response pass can run packed: float32 attention (the implementation that
    reads the packing), every layer attending to everything before it (no sliding window,
    whose mask the packing does not build), a cache of plain keys and values."""
    config = decoder.config
    return (
        getattr(config, "_attn_implementation", None) == FLOAT32_SDPA
        and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ())
        and all(type(layer) is DynamicLayer for layer in cache.layers)
    )


def _packed_responses(
    decoder: torch.nn.Module,
    mb: MicroBatch,
    sp: SharedPrompts,
    cache: DynamicCache,
    first: torch.Tensor,
) -> torch.Tensor:
    """[B, R, d] as the padded pass gives it, the response inputs run as one packed row."""
    rows, width = mb.response_ids.shape
    inputs = sp.response_mask[:, 1:] > 0  # [B, W]: input t predicts token t + 1, a real one
    w = width - 1
    index = inputs.reshape(-1).nonzero().squeeze(1)
    prompt_len = sp.mask.sum(-1).index_select(0, sp.row)
    positions = (prompt_len.unsqueeze(1) + torch.arange(w, device=index.device)).reshape(-1)
    causal = torch.ones(w, w, dtype=torch.bool, device=index.device).tril()
    prompt_mask = (sp.mask > 0).index_select(0, sp.row).unsqueeze(1).expand(-1, w, -1)
    # A padded query sees its prompt too, so that no row of the mask is empty (NaN in SDPA).
    mask = torch.cat([prompt_mask, causal & inputs.unsqueeze(1)], dim=2).unsqueeze(1)
    n = index.numel()
    packed = PackedResponses(
        [layer.keys for layer in cache.layers],
        [layer.values for layer in cache.layers],
        sp.row,
        index,
        w,
        n,
        mask,
    )
    extra = torch.zeros(bucket_length(n) - n, dtype=torch.long, device=index.device)
    ids = mb.response_ids[:, :-1].reshape(-1).index_select(0, index)
    rest = decoder(
        input_ids=torch.cat([ids, extra]).unsqueeze(0),  # token 0 after the real ones
        position_ids=torch.cat([positions.index_select(0, index), extra]).unsqueeze(0),
        use_cache=False,
        packed=packed,
    ).last_hidden_state[0, :n]  # [N, d]
    # Token 0 of row b goes to slot b * R, packed input (b, t) to slot b * R + t + 1.
    slots = torch.cat(
        [
            torch.arange(rows, device=index.device) * width,
            (index // w) * width + index % w + 1,
        ]
    )
    hidden = torch.cat([first, rest])
    out = hidden.new_zeros(rows * width, hidden.shape[-1]).index_copy(0, slots, hidden)
    return out.view(rows, width, -1)


def _select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep `rows` [B] of the cache's batch (repeats allowed), as batch_select_indices does, but
    with index_select, whose backward adds repeated rows in a fixed order (see the caller)."""
    for layer in cache.layers:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(rows)  # a layer holding more than keys and values
        elif layer.get_seq_length() > 0:
            layer.keys = layer.keys.index_select(0, rows)
            layer.values = layer.values.index_select(0, rows)
