"""The float32 attention's batched products for small masked calls (models/attention.py):
SDPA's outputs and gradients to float32 rounding, and SDPA itself where they would differ."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import relax_core.models.attention as attention


def _inputs(rows: int, heads: int, kv_heads: int, width: int, keys: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, width, 16, generator=g, requires_grad=True)
    k = torch.randn(rows, kv_heads, keys, 16, generator=g, requires_grad=True)
    v = torch.randn(rows, kv_heads, keys, 16, generator=g, requires_grad=True)
    return q, k, v


def _response_mask(rows: int, width: int, prompt: int, seed: int = 0) -> torch.Tensor:
    """[rows, 1, width, prompt + width]: the prompt's keys, then the row's inputs causally, each
    row with its own number of real inputs (a padding query sees the prompt, as in training)."""
    g = torch.Generator().manual_seed(seed)
    real = torch.randint(1, width + 1, (rows,), generator=g)
    inputs = torch.arange(width)[None, :] < real[:, None]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    own = causal[None] & inputs[:, None, :]
    return torch.cat([torch.ones(rows, width, prompt, dtype=torch.bool), own], 2).unsqueeze(1)


def _sdpa(q, k, v, mask, scale):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 6), (4, 4), (6, 2)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_small_masked_calls_give_sdpa_outputs_and_gradients(heads, kv_heads, scale):
    rows, width, prompt = 24, 4, 7
    mask = _response_mask(rows, width, prompt)
    grad_out = torch.randn(rows, heads, width, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for compute in (_sdpa, lambda q, k, v, m, s: attention._attend(q, k, v, m, {"scaling": s})):
        q, k, v = _inputs(rows, heads, kv_heads, width, prompt + width)
        out = compute(q, k, v, mask, scale)
        out.backward(grad_out)
        results.append((out.detach(), q.grad, k.grad, v.grad))
    q, k, _ = _inputs(rows, heads, kv_heads, width, prompt + width)
    assert attention._small(q, k, mask)
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_a_prompt_mask_shared_by_every_row_broadcasts():
    q, k, v = _inputs(8, 12, 6, 7, 7)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]  # [1, 1, Q, K]
    assert attention._small(q, k, mask)
    got = attention._attend(q, k, v, mask, {})
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, None), rtol=1e-5, atol=2e-6)


def test_values_narrower_than_the_heads_keep_their_width():
    q, k, _ = _inputs(8, 12, 6, 4, 11)
    v = torch.randn(8, 6, 11, 8, generator=torch.Generator().manual_seed(2))
    mask = _response_mask(8, 4, 7)
    got = attention._attend(q, k, v, mask, {})
    assert got.shape == (8, 12, 4, 8)
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, None), rtol=1e-5, atol=2e-6)


def test_a_query_without_keys_takes_sdpa_and_gets_zeros(monkeypatch):
    q, k, v = _inputs(4, 12, 6, 4, 11)
    mask = _response_mask(4, 4, 7)
    mask[2, 0, 1] = False  # row 2's second query sees nothing
    assert not attention._small(q, k, mask)
    calls = []
    real = attention.F.scaled_dot_product_attention
    monkeypatch.setattr(
        attention.F,
        "scaled_dot_product_attention",
        lambda *a, **kw: calls.append(1) or real(*a, **kw),
    )
    out = attention._attend(q, k, v, mask, {})
    assert calls and not out.isnan().any()
    assert torch.equal(out[2, :, 1], torch.zeros_like(out[2, :, 1]))


@pytest.mark.parametrize(
    ("case", "width", "keys", "mask"),
    [
        ("too many query positions x keys", 32, 92, "bool"),
        ("an additive float mask", 4, 11, "float"),
        ("no mask", 4, 11, None),
    ],
)
def test_other_calls_keep_sdpa(case, width, keys, mask):
    q, k, _ = _inputs(2, 12, 6, width, keys)
    if mask is not None:
        m = torch.ones(2, 1, width, keys, dtype=torch.bool)
        mask = m if mask == "bool" else torch.zeros(m.shape)
    assert width * keys > attention.SMALL_ATTENTION or mask is None or mask.dtype != torch.bool
    assert not attention._small(q, k, mask), case
