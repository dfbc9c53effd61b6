"""Torch train backend: micro-batching is exact, log-probs agree with the engine, state round-trips."""

from __future__ import annotations

import copy

import pytest
import torch

from relax_core.algorithms import LossInputs, LossSettings, grpo_loss
from relax_core.config import ModelConfig
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch, split_by_token_budget
from relax_core.train.torch_backend import TorchBackend

SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _rollout(tok, n=8):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=3)
    texts = [f"{a}+{a * 3}=" for a in range(n)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    return model, prompts, outs


def _mb(tok, prompts, outs, rows, adv):
    return make_micro_batch(
        [prompts[i] for i in rows],
        [outs[i].response_ids for i in rows],
        [[1] * len(outs[i].response_ids) for i in rows],
        tok.pad_token_id,
        {
            "advantages": [[adv[i]] * len(outs[i].response_ids) for i in rows],
            "rollout_logprobs": [outs[i].logprobs for i in rows],
        },
    )


def test_backend_logprobs_equal_the_engines(tok):
    model, prompts, outs = _rollout(tok)
    backend = TorchBackend(model, lr=1e-3)
    (logp,) = backend.logprobs([_mb(tok, prompts, outs, range(8), [0.0] * 8)])
    for i, c in enumerate(outs):
        assert logp[i, : len(c.logprobs)].tolist() == pytest.approx(c.logprobs, abs=1e-4)


def _grads_after_step(tok, split):
    model, prompts, outs = _rollout(tok)
    adv = [1.0, -1.0, 0.5, -0.5, 2.0, 0.0, -2.0, 1.5]
    backend = TorchBackend(model, lr=1e-3, grad_clip=0.0)
    batches = [_mb(tok, prompts, outs, rows, adv) for rows in split]
    num_tokens = float(sum(mb.loss_mask.sum() for mb in batches))

    def loss_fn(logprobs, entropy, mb):
        inputs = LossInputs(logprobs, logprobs.detach(), mb.extras["advantages"], mb.loss_mask)
        return grpo_loss(inputs, LossSettings(), num_tokens=num_tokens)

    metrics = backend.train_step(batches, loss_fn)
    # Compare gradients, not updated weights: Adam divides by sqrt(v) and blows up round-off.
    return metrics["grad_norm"], [p.grad.clone() for p in model.parameters()]


def test_one_micro_batch_of_8_equals_8_of_1(tok):
    norm_a, grads_a = _grads_after_step(tok, [list(range(8))])
    norm_b, grads_b = _grads_after_step(tok, [[i] for i in range(8)])
    assert norm_a == pytest.approx(norm_b, rel=1e-4)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_token_budget_split():
    # lengths 10, 3, 8, 2 with budget 16: longest first -> [10] (10+8 would pad to 2 x 10 = 20),
    # [8, 3] (2 x 8 = 16), then [2] would make 3 x 8 = 24 > 16 -> its own batch.
    assert split_by_token_budget([10, 3, 8, 2], 16) == [[0], [2, 1], [3]]
    # a row longer than the budget still gets a batch of its own
    assert split_by_token_budget([40, 1], 16) == [[0], [1]]


def test_micro_batch_positions_point_at_the_predicting_token(tok):
    mb = make_micro_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], [[1, 1], [1, 1, 1]], 0)
    # row 0: prompt of 3 -> response tokens predicted at positions 2, 3 (third pads to the end)
    assert mb.response_positions[0, :2].tolist() == [2, 3]
    assert mb.response_positions[1].tolist() == [0, 1, 2]
    assert mb.input_ids.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert mb.loss_mask.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_optimizer_state_round_trips(tok, tmp_path):
    model, prompts, outs = _rollout(tok)
    backend = TorchBackend(model, lr=1e-2)
    mb = _mb(tok, prompts, outs, range(8), [1.0, -1.0] * 4)

    def loss_fn(logprobs, entropy, mb):
        return -(logprobs * mb.extras["advantages"] * mb.loss_mask).sum(), {}

    backend.train_step([mb], loss_fn)
    backend.save(str(tmp_path))
    restored = TorchBackend(copy.deepcopy(model), lr=1e-2)
    restored.load(str(tmp_path))
    backend.train_step([mb], loss_fn)
    restored.train_step([mb], loss_fn)
    for a, b in zip(backend.model.parameters(), restored.model.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_a_shared_prompt_gives_the_log_probs_and_gradients_of_whole_sequences(tok):
    """Rows repeating a prompt (a group's samples) run it once and reuse its keys and values;
    log-probs, entropies and gradients stay those of each row's whole sequence."""
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=3)
    texts = ["1+2=", "40+2=", "1+2=", "7*8=", "40+2=", "1+2="]  # 3 distinct, lengths differ
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    responses = [c.response_ids for c in outs]
    masks = [[1] * len(r) for r in responses]
    masks[2][0] = 0  # a masked token (an env observation) is still context

    def run(share: bool):
        mb = make_micro_batch(prompts, responses, masks, tok.pad_token_id, share_prompts=share)
        model.zero_grad()
        backend = TorchBackend(model, lr=1e-3)
        logp, entropy = backend._forward(mb)
        ((logp + entropy) * mb.loss_mask).sum().backward()
        return mb, logp.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]

    whole, logp_a, ent_a, grads_a = run(False)
    shared, logp_b, ent_b, grads_b = run(True)
    assert whole.shared is None and shared.shared is not None
    assert shared.shared.ids.shape[0] == 3  # each prompt once
    mask = whole.loss_mask.bool()
    torch.testing.assert_close(logp_a[mask], logp_b[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent_a[mask], ent_b[mask], rtol=0, atol=1e-5)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for i, c in enumerate(outs):  # and they are the engine's
        assert logp_b[i, : len(c.logprobs)].tolist() == pytest.approx(c.logprobs, abs=1e-4)


def test_ragged_rows_pad_to_a_left_aligned_block():
    from relax_core.train.batch import pad_2d

    out = pad_2d([[1, 2, 3], [], [4]], 4, -1, torch.long)
    assert out.tolist() == [[1, 2, 3, -1], [-1, -1, -1, -1], [4, -1, -1, -1]]
    assert pad_2d([], 3, 0.0, torch.float32).shape == (0, 3)
    assert pad_2d([[0.5], [1.5, 2.5]], 2, 0.0, torch.float32).tolist() == [[0.5, 0.0], [1.5, 2.5]]


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_lm_head_scores_real_response_tokens_only(tok, share, temperature):
    """Rows of different response lengths: the LM head sees each real response token once (no
    padding), their log-probs are those of a plain forward over each whole sequence, and padded
    positions read 0."""
    model, prompts, outs = _rollout(tok)
    prompts = prompts[:3] + prompts[:3]  # repeated prompts, so `share` takes the shared path
    responses = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [], [15, 16]]
    mb = make_micro_batch(
        prompts, responses, [[1] * len(r) for r in responses], tok.pad_token_id, share_prompts=share
    )
    assert (mb.shared is not None) == share
    head_rows = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: head_rows.append(args[0].shape[0])
    )
    logp, entropy = TorchBackend(model, lr=1e-3, temperature=temperature)._forward(mb)
    hook.remove()
    assert head_rows == [sum(len(r) for r in responses)]  # 12 real tokens, 6 x 4 with padding
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        n = len(r)
        assert logp[i, n:].tolist() == [0.0] * (4 - n)
        assert entropy[i, n:].tolist() == [0.0] * (4 - n)
        if n == 0:
            continue
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]
        expected = torch.log_softmax(logits / temperature, -1)[torch.arange(n), torch.tensor(r)]
        torch.testing.assert_close(logp[i, :n].detach(), expected, rtol=0, atol=1e-5)


def test_shared_prompt_gradients_repeat_bit_for_bit_on_two_threads(tok):
    """Rows that repeat a prompt add their gradients into its keys and values. With advanced
    indexing, whose CPU backward adds them with atomic adds from several threads, the order
    varied: one micro-batch gave different gradients from one backward to the next, and runs of
    the CPU default drifted apart. Sized like the CPU default so the kernels go parallel."""
    cfg = ModelConfig(
        hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=4, intermediate_size=512
    )
    model = build_tiny_qwen3(cfg, len(tok), seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [tok(f"{a}+{a * 7 % 90}=", add_special_tokens=False)["input_ids"] for a in range(32)]
    # 32 groups of 8 samples, interleaved as micro-batching (longest first) leaves them: rows
    # of one prompt in both halves of the batch, which the threads split between them.
    order = torch.randperm(256, generator=g).tolist()
    rows = [prompts[i // 8] for i in order]
    responses = torch.randint(3, len(tok), (256, 4), generator=g).tolist()
    mb = make_micro_batch(rows, responses, [[1] * 4] * 256, tok.pad_token_id, share_prompts=True)
    assert mb.shared is not None
    backend = TorchBackend(model, lr=1e-3)
    weights = torch.randn(256, 4, generator=g)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(8):
            model.zero_grad()
            logp, _ = backend._forward(mb)
            (logp * weights).sum().backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    finally:
        torch.set_num_threads(threads)
    for other in grads[1:]:
        assert torch.equal(grads[0], other)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_entropy_is_differentiated_only_for_an_entropy_term(tok, entropy_grad):
    """Without an entropy bonus the entropy is a metric: same values, no graph kept behind its
    [N, V] probabilities; with one, the entropy's gradient reaches the weights."""
    model, prompts, outs = _rollout(tok)
    backend = TorchBackend(model, lr=1e-3, grad_clip=0.0, entropy_grad=entropy_grad)
    mb = _mb(tok, prompts, outs, range(8), [0.0] * 8)
    logprobs, entropy = backend._forward(mb)
    assert logprobs.requires_grad
    assert entropy.requires_grad == entropy_grad
    reference = TorchBackend(copy.deepcopy(model), lr=1e-3)._forward(mb)[1]
    assert torch.equal(entropy.detach(), reference.detach())
    assert float(entropy.sum()) > 0

    def entropy_bonus(logprobs, entropy, mb):
        inputs = LossInputs(
            logprobs, logprobs.detach(), mb.extras["advantages"], mb.loss_mask, entropy=entropy
        )
        return grpo_loss(inputs, LossSettings(entropy_coef=0.1), num_tokens=8.0)

    if entropy_grad:  # zero advantages: the entropy term alone moves the weights
        backend.train_step([mb], entropy_bonus)
        assert any(float(p.grad.abs().sum()) > 0 for p in model.parameters())
