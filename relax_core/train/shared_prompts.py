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

With that attention the prompts run in the same packed row, ahead of the responses: one pass
through every layer instead of a prompt pass and a response pass, whose small ops (norms,
rotary, casts) cost as much as their matmuls at the CPU default's size (a micro-batch's forward
21.8 -> 18.6 ms, its backward 28.9 -> 24.4 ms, bench/RESULTS.md). Each row of a matrix product
is computed alone, so the log-probs stay the two passes' bit for bit (tests/unit/
test_packed_responses.py); the weight gradients sum prompt and response tokens in one product,
another grouping, and differ in rounding.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from relax_core.models.attention import FLOAT32_SDPA, PackedPrompts, PackedResponses
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
    width = mb.response_ids.shape[1]
    if width > 1 and _packs(decoder):
        return _one_pass(decoder, mb, sp)
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
    if width == 1:
        return first.unsqueeze(1)
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


def runs_shared(model: PreTrainedModel, mb: MicroBatch) -> bool:
    """Whether `mb`'s forward takes this module's path: it has shared prompts, and either runs
    packed (one pass) or its layers keep a KV cache between the prompt and the response passes.
    Layers that recompute in backward (train.activation_checkpointing) keep none: transformers
    turns use_cache off for them, so their rows run whole instead."""
    if mb.shared is None:
        return False
    decoder = model.get_decoder()
    if mb.response_ids.shape[1] > 1 and _packs(decoder):
        return True
    return not any(getattr(m, "gradient_checkpointing", False) for m in decoder.modules())


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


def _packs(decoder: torch.nn.Module) -> bool:
    """Whether the forward can run packed: float32 attention (the implementation that reads the
    packing), every layer attending to everything before it (no sliding window, whose mask the
    packing does not build)."""
    config = decoder.config
    return getattr(config, "_attn_implementation", None) == FLOAT32_SDPA and all(
        t == "full_attention" for t in getattr(config, "layer_types", None) or ()
    )


_NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def _packed_prompts(sp: SharedPrompts) -> tuple[PackedPrompts, torch.Tensor, torch.Tensor]:
    """The distinct prompts' layout in the packed row, their token ids and positions."""
    count, width = sp.ids.shape
    device = sp.ids.device
    real = sp.mask > 0
    index = real.reshape(-1).nonzero().squeeze(1)
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    # A padding query sees itself only, so that no row of the mask is empty (NaN in SDPA).
    seen = (causal & real.unsqueeze(1)) | torch.eye(width, dtype=torch.bool, device=device)
    layout = PackedPrompts(index, count, width, seen.unsqueeze(1))
    positions = (sp.mask.cumsum(-1) - 1).reshape(-1).index_select(0, index)
    return layout, sp.ids.reshape(-1).index_select(0, index), positions


def _one_pass(decoder: torch.nn.Module, mb: MicroBatch, sp: SharedPrompts) -> torch.Tensor:
    """[B, R, d] as a prompt pass and a padded response pass give it, from one packed row: the
    distinct prompts' real tokens, then the response inputs' real tokens, then zeros up to a
    bucketed length."""
    rows, width = mb.response_ids.shape
    device = sp.ids.device
    prompts, prompt_ids, prompt_positions = _packed_prompts(sp)
    inputs = sp.response_mask[:, 1:] > 0  # [B, W]: input t predicts token t + 1, a real one
    w = width - 1
    index = inputs.reshape(-1).nonzero().squeeze(1)
    prompt_len = sp.mask.sum(-1)
    positions = prompt_len.index_select(0, sp.row).unsqueeze(1) + torch.arange(w, device=device)
    causal = torch.ones(w, w, dtype=torch.bool, device=device).tril()
    prompt_mask = (sp.mask > 0).index_select(0, sp.row).unsqueeze(1).expand(-1, w, -1)
    # A padded query sees its prompt too, so that no row of the mask is empty (NaN in SDPA).
    mask = torch.cat([prompt_mask, causal & inputs.unsqueeze(1)], dim=2).unsqueeze(1)
    m, n = prompt_ids.numel(), index.numel()
    packed = PackedResponses(prompts, sp.row, index, w, n, mask)
    extra = torch.zeros(bucket_length(m + n) - m - n, dtype=torch.long, device=device)
    ids = mb.response_ids[:, :-1].reshape(-1).index_select(0, index)
    hidden = decoder(
        input_ids=torch.cat([prompt_ids, ids, extra]).unsqueeze(0),
        # The packing carries the masks. A 4D mask is taken as prepared (transformers'
        # masking_utils), so none is built: from the packed row's positions transformers would
        # build an [L, L] one that nothing reads (~3 ms a forward on the CPU default).
        attention_mask=_NO_MASK,
        position_ids=torch.cat(
            [prompt_positions, positions.reshape(-1).index_select(0, index), extra]
        ).unsqueeze(0),
        use_cache=False,
        packed=packed,
    ).last_hidden_state[0]
    # Response token 0 is predicted by its prompt's last token (index_select: see above).
    first = hidden.index_select(0, prompt_len.cumsum(0) - 1).index_select(0, sp.row)
    # Token 0 of row b goes to slot b * R, packed input (b, t) to slot b * R + t + 1.
    slots = torch.cat(
        [
            torch.arange(rows, device=device) * width,
            (index // w) * width + index % w + 1,
        ]
    )
    out = hidden.new_zeros(rows * width, hidden.shape[-1])
    out = out.index_copy(0, slots, torch.cat([first, hidden[m : m + n]]))
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
