"""A generation step's attention on the CPU (models/attention._decode_attention): one query
position per row, batched over rows instead of SDPA's per-(row, head) tasks. It must give what
transformers' SDPA path gives for every mask a decode step can carry, leave calls it does not
cover to SDPA, and leave what the engine generates unchanged."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from relax_core.config import ModelConfig
from relax_core.models import attention
from relax_core.models.attention import sdpa_float32, use_float32_attention
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.layer_idx, self.is_causal = groups, 0, True


def _inputs(rows=5, heads=6, kv_heads=3, keys=7, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, 1, dim, generator=g)
    k = torch.randn(rows, kv_heads, keys, dim, generator=g)
    v = torch.randn(rows, kv_heads, keys, dim, generator=g)
    return q, k, v


def _sdpa(layer, q, k, v, mask, **kwargs):
    """transformers' own SDPA path: the reference."""
    return sdpa_attention_forward(layer, q, k, v, mask, **kwargs)[0]


@pytest.mark.parametrize("heads,kv_heads", [(6, 3), (4, 4), (6, 2)])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "broadcast"])
def test_a_decode_step_attends_as_sdpa(heads, kv_heads, mask_kind):
    q, k, v = _inputs(heads=heads, kv_heads=kv_heads)
    keys = k.shape[2]
    allowed = torch.rand(q.shape[0], 1, 1, keys, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., -1] = True  # a row's own newest token
    mask = {
        "none": None,
        "bool": allowed,
        "float": torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf")),
        "broadcast": allowed[:1],
    }[mask_kind]
    layer = _Layer(heads // kv_heads)
    with torch.no_grad():
        ours, _ = sdpa_float32(layer, q, k, v, mask, dropout=0.0, scaling=0.3)
        ref = _sdpa(layer, q, k, v, mask, dropout=0.0, scaling=0.3)
    assert ours.shape == ref.shape == (q.shape[0], 1, heads, q.shape[-1])
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)


def test_a_row_with_every_key_masked_gets_zeros_as_sdpa_gives_it():
    q, k, v = _inputs()
    mask = torch.ones(q.shape[0], 1, 1, k.shape[2], dtype=torch.bool)
    mask[2] = False
    with torch.no_grad():
        ours, _ = sdpa_float32(_Layer(2), q, k, v, mask)
        ref = _sdpa(_Layer(2), q, k, v, mask)
    assert torch.equal(ours[2], torch.zeros_like(ours[2]))
    assert torch.isfinite(ours).all()
    torch.testing.assert_close(ours, ref, rtol=0, atol=2e-6)


def test_a_bf16_query_comes_back_in_bf16_computed_in_float32():
    q, k, v = _inputs()
    with torch.no_grad():
        ours, _ = sdpa_float32(_Layer(2), q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
        exact = [x.bfloat16().float() for x in (q, k, v)]
        ref = _sdpa(_Layer(2), *exact, None)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref, rtol=8e-3, atol=8e-3)  # bf16's rounding


def test_calls_it_does_not_cover_go_to_sdpa(monkeypatch):
    taken = []
    monkeypatch.setattr(attention, "_decode_attention", lambda *a: taken.append(a))
    q, k, v = _inputs()
    layer = _Layer(2)
    sdpa_float32(layer, q.requires_grad_(), k, v, None)  # a gradient is wanted
    with torch.no_grad():
        sdpa_float32(layer, torch.randn(5, 6, 3, 16), k, v, None)  # several query positions
        sdpa_float32(layer, q, k, v, None, dropout=0.1)
        per_head = torch.ones(5, 6, 1, k.shape[2], dtype=torch.bool)  # a mask per head
        sdpa_float32(layer, q, k, v, per_head)
    assert taken == []
    with torch.no_grad():
        sdpa_float32(layer, q, k, v, None)
    assert len(taken) == 1


def test_the_engine_generates_the_same_tokens_with_it(monkeypatch):
    """Greedy generation of a grouped-query tiny Qwen3 (prompts of several lengths, so left
    padding is masked) with the decode path and with SDPA for every step."""
    tok = build_char_tokenizer()
    cfg = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
    )
    model = build_tiny_qwen3(cfg, len(tok), seed=3)
    use_float32_attention(model)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("12+7=", "3+4=", "45+16=")]
    params = SamplingParams(max_new_tokens=6, temperature=1.0, greedy=True)
    taken = []
    decode = attention._decode_attention
    monkeypatch.setattr(attention, "_decode_attention", lambda *a: taken.append(1) or decode(*a))

    def generate():
        engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
        engine.lean = None  # transformers' forward (the lean one: tests/unit/test_lean_decoder.py)
        return [(c.response_ids, c.logprobs) for c in engine.generate(prompts * 2, params)]

    fast = generate()
    assert taken, "the engine's decode steps did not take the decode path"
    monkeypatch.setattr(attention, "_decode_step", lambda *a: False)
    slow = generate()
    assert [t for t, _ in fast] == [t for t, _ in slow]
    for (_, a), (_, b) in zip(fast, slow, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
