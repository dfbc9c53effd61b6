"""The packed training forward (train/shared_prompts.py): under `model.matmul_dtype`'s float32
attention a shared-prompt micro-batch runs its distinct prompts' and its responses' real tokens
as one row, in one pass, without padding. It scores as a prompt pass and a padded response pass
do, bit for bit; trains to their gradients (to float32 rounding in float32, to bf16 rounding of
the weight gradients' products under autocast); repeats bit for bit; and other attention
implementations keep the two padded passes."""

from __future__ import annotations

import os

import pytest
import torch

import relax_core.train.shared_prompts as shared_prompts
from relax_core.config import ModelConfig, load_config, replace
from relax_core.models.attention import use_float32_attention
from relax_core.models.precision import bucket_length
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.train.batch import make_micro_batch
from relax_core.train.factory import make_backend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Grouped-query attention, as the CPU default and SmolLM2.
SMALL = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _backend(tok, matmul_dtype: str, model_cfg: ModelConfig = SMALL):
    cfg = replace(
        load_config(os.path.join(REPO, "configs", "cpu-default.yaml")),
        model={"matmul_dtype": matmul_dtype},
    )
    model = build_tiny_qwen3(model_cfg, len(tok), seed=0)
    return model, make_backend(model, cfg)


def _batch(tok):
    texts = ["1+2=", "40+2=", "1+2=", "7*8=", "40+2=", "1+2=", "7*8=", "40+2="]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # Lengths 1 to 6 (an empty response too), so most of the padded [8, 5] inputs are padding.
    responses = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14, 15, 16], [], [17, 18], [19], [6] * 5]
    masks = [[1] * len(r) for r in responses]
    masks[3][1] = 0  # a loss-masked token (an env observation) is still context
    return make_micro_batch(prompts, responses, masks, tok.pad_token_id, share_prompts=True)


def _train_pass(model, backend, mb, weights):
    """(log-probs, entropies, gradients, the token counts layer 0's query projection saw)."""
    seen = []
    hook = (
        model.get_decoder()
        .layers[0]
        .self_attn.q_proj.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].shape[:-1].numel())
        )
    )
    model.zero_grad()
    logp, entropy = backend._forward(mb)
    (logp * weights).sum().backward()
    hook.remove()
    grads = [p.grad.clone() for p in model.parameters()]
    return logp.detach(), entropy.detach(), grads, seen


def test_the_packed_pass_scores_as_the_padded_one_without_computing_padding(tok, monkeypatch):
    mb = _batch(tok)
    weights = torch.linspace(-1.0, 1.0, mb.loss_mask.numel()).view(mb.loss_mask.shape)
    weights = weights * mb.loss_mask
    model, backend = _backend(tok, "bfloat16")
    packed = _train_pass(model, backend, mb, weights)
    monkeypatch.setattr(shared_prompts, "_packs", lambda *_: False)
    model, backend = _backend(tok, "bfloat16")
    padded = _train_pass(model, backend, mb, weights)

    assert torch.equal(packed[0], padded[0]) and torch.equal(packed[1], padded[1])
    # A weight gradient's product now sums the prompt and response tokens together, and under
    # autocast each product's result is rounded to bf16: the two ways land up to a bf16 step or
    # two of the tensor's largest entry apart (an entry where the two parts cancel can differ
    # by more than its own size). Float32 throughout, they agree to float32 rounding (below).
    for a, b in zip(packed[2], padded[2], strict=True):
        assert (a - b).abs().max() <= 2**-6 * b.abs().max()
    # Two passes: 3 distinct prompts of 5 columns, then 8 rows x 5 inputs padded. One packed
    # pass: the prompts' 4 + 5 + 4 real tokens and 2 + 0 + 1 + 5 + 0 + 1 + 0 + 4 = 13 inputs.
    assert padded[3] == [15, 40]
    assert packed[3] == [26]


def test_in_float32_the_one_pass_trains_as_the_two_passes(tok, monkeypatch):
    """With float32 attention on a float32 policy (no autocast rounding between), the packed
    pass's gradients are the two passes' to float32 rounding: the same update, not a near one."""
    mb = _batch(tok)
    weights = torch.linspace(-1.0, 1.0, mb.loss_mask.numel()).view(mb.loss_mask.shape)
    weights = weights * mb.loss_mask
    runs = []
    for packs in (True, False):
        if not packs:
            monkeypatch.setattr(shared_prompts, "_packs", lambda *_: False)
        model, backend = _backend(tok, "")
        use_float32_attention(model)
        runs.append(_train_pass(model, backend, mb, weights))
    (logp, _, grads, seen), (logp2, _, grads2, seen2) = runs
    assert seen == [26] and seen2 == [15, 40]
    torch.testing.assert_close(logp, logp2, rtol=0, atol=1e-6)
    # Float32 rounding is relative to a tensor's scale: the packed row (26 x 26 positions) goes
    # through SDPA, the padded passes through the batched small-attention matmuls, so sums run
    # in other orders, and an entry where terms cancel can differ by more than its own 1e-5.
    # Measured: at most 7e-7 of the tensor's largest entry; a wrong mask or position is ~1e-2.
    for a, b in zip(grads, grads2, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_a_float32_policy_keeps_the_padded_pass(tok):
    """transformers' own attention does not read the packing: the response pass stays padded."""
    mb = _batch(tok)
    model, backend = _backend(tok, "")
    *_, seen = _train_pass(model, backend, mb, mb.loss_mask)
    assert seen == [15, 40]


def test_the_packed_row_takes_a_few_lengths_only():
    """Its length is a matrix dimension of every linear layer, a compiled kernel each: a step's
    few hundred tokens round up to one of 8 lengths an octave, at most an eighth longer."""
    for n in range(1, 5000):
        assert n <= bucket_length(n) <= n + n // 8
    assert {bucket_length(n) for n in range(600, 700)} == {640, 704}


def test_packed_gradients_repeat_bit_for_bit_on_two_threads(tok):
    """Sized like the CPU default, so that the kernels go parallel; its groups of 8 samples
    interleaved as micro-batching (longest first) leaves them."""
    cfg = ModelConfig(
        hidden_size=192, num_layers=2, num_heads=12, num_kv_heads=6, intermediate_size=768
    )
    model, backend = _backend(tok, "bfloat16", cfg)
    g = torch.Generator().manual_seed(0)
    prompts = [tok(f"{a}+{a * 7 % 90}=", add_special_tokens=False)["input_ids"] for a in range(32)]
    order = torch.randperm(256, generator=g).tolist()
    rows = [prompts[i // 8] for i in order]
    lengths = torch.randint(1, 6, (256,), generator=g).tolist()
    responses = [torch.randint(3, len(tok), (n,), generator=g).tolist() for n in lengths]
    mb = make_micro_batch(
        rows, responses, [[1] * n for n in lengths], tok.pad_token_id, share_prompts=True
    )
    weights = torch.randn(mb.loss_mask.shape, generator=g) * mb.loss_mask
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [_train_pass(model, backend, mb, weights) for _ in range(4)]
    finally:
        torch.set_num_threads(threads)
    assert len(runs[0][3]) == 1 and runs[0][3][0] < 32 * 6 + 256 * 4  # one packed pass
    for logp, _, grads, _ in runs[1:]:
        assert torch.equal(logp, runs[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, runs[0][2], strict=True))
