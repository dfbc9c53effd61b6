"""The torch engine's lean generation forward (rollout/decoder.py) and its two-level sampler:
what a user sees is the same tokens and log-probs as transformers' forward gives, on the models
it takes, and transformers' forward on every model it does not."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from relax_core.config import ModelConfig
from relax_core.config.sections import LoraConfig
from relax_core.models import lora
from relax_core.models.precision import computing_as_trainer
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.decoder import lean_decoder
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.sampling import CDF_BLOCK, inverse_cdf
from relax_core.rollout.torch_engine import TorchEngine

GQA = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _prompts(tok):
    texts = ["12+7=", "3+4=", "45+16=", "3+4=", "9=", "12+7="] * 4  # repeats, several lengths
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _both(model, tok, params, seed=5):
    """(lean, transformers) completions of the same prompts from engines of the same seed."""
    lean = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=seed)
    assert lean.lean is not None, "the engine did not take the lean forward for this model"
    plain = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=seed)
    plain.lean = None
    return lean.generate(_prompts(tok), params), plain.generate(_prompts(tok), params)


def _assert_same(a, b):
    assert [c.response_ids for c in a] == [c.response_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(
            torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=0, atol=1e-5
        )


def test_sampled_generation_equals_transformers_forward(tok):
    model = build_tiny_qwen3(GQA, len(tok), seed=3)
    with torch.no_grad():  # a flat head: rows end at several steps, so the decode batch shrinks
        model.lm_head.weight.mul_(0.05)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    lean, plain = _both(model, tok, params)
    assert len({len(c.response_ids) for c in lean}) > 2, "every row ended at the same step"
    _assert_same(lean, plain)


def test_bf16_matmul_and_lora_policies_generate_as_transformers_does(tok):
    model = computing_as_trainer(build_tiny_qwen3(GQA, len(tok), seed=4), "bfloat16")
    _assert_same(*_both(model, tok, SamplingParams(max_new_tokens=8, temperature=1.0)))
    adapted = lora.for_run(
        build_tiny_qwen3(GQA, len(tok), seed=4), LoraConfig(rank=4, alpha=8), seed=0
    )
    with torch.no_grad():  # adapters that change the output (B starts at zero)
        for name, p in adapted.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    _assert_same(*_both(adapted, tok, SamplingParams(max_new_tokens=8, greedy=True)))


def test_a_llama_policy_takes_the_lean_forward(tok):
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    _assert_same(*_both(LlamaForCausalLM(config), tok, SamplingParams(max_new_tokens=8)))


def test_models_it_does_not_compute_keep_transformers_forward(tok):
    moe = build_tiny_qwen3(
        ModelConfig(**{**GQA.__dict__, "num_experts": 4, "experts_per_token": 2}), len(tok), 0
    )
    assert lean_decoder(moe) is None
    windowed = build_tiny_qwen3(GQA, len(tok), seed=0)
    windowed.config.use_sliding_window = True
    assert lean_decoder(windowed) is None
    scaled = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        )
    )  # fmt: skip
    assert lean_decoder(scaled) is None
    engine = TorchEngine(copy.deepcopy(moe), tok.eos_token_id, tok.pad_token_id)
    assert engine.lean is None
    assert len(engine.generate(_prompts(tok)[:3], SamplingParams(max_new_tokens=3))) == 3


def test_two_level_sampling_draws_as_one_running_sum_does():
    g = torch.Generator().manual_seed(0)
    vocab = 40 * CDF_BLOCK + 77  # a last block shorter than the others
    logits = torch.randn(16, vocab, generator=g) * 4
    logits[:, ::5] = -float("inf")  # tokens without mass
    probs = torch.softmax(logits, -1)
    cdf = probs.double().cumsum(-1)
    for _ in range(50):
        u = torch.rand(16, generator=g, dtype=torch.float64)
        one_sum = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
        picked = inverse_cdf(probs, u)
        assert torch.equal(picked, one_sum)
        assert bool((probs.gather(1, picked.unsqueeze(-1)) > 0).all())
    # The last draw before 1 lands on the last token with mass, never on one without.
    last = inverse_cdf(probs, torch.full((16,), 1 - 2**-53, dtype=torch.float64))
    assert bool((probs.gather(1, last.unsqueeze(-1)) > 0).all())
