"""The supervised warm start: its greedy probe reads what greedy decoding would answer, and a
target accuracy ends it as soon as the probe reaches it (and no later than warm_start.steps)."""

from __future__ import annotations

import random

import pytest
import torch

from relax_core.config import ConfigError, ModelConfig, config_from_dict
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.run.prepare import PolicySpec
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import greedy_matches
from relax_core.train.warm_start import (
    CHECK_EVERY,
    answer_example,
    warm_start,
    weakest_length_accuracy,
)

SMALL = ModelConfig(
    kind="tiny-qwen3", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
    intermediate_size=64,
)  # fmt: skip


def _prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    texts = [f"{rng.randint(0, 99):02d}+{rng.randint(0, 99):02d}=" for _ in range(n)]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_greedy_matches_is_what_greedy_decoding_answers():
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(SMALL, len(tok), seed=3).eval()
    prompts = _prompts(tok, 12)
    x = torch.tensor(prompts)
    with torch.no_grad():
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=3, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    greedy = [row[x.shape[1] :].tolist() for row in out]
    # Each row's own greedy answer matches; the same answer with one token changed does not,
    # unless the change falls on a token the loss mask leaves out.
    changed = [[*r[:-1], (r[-1] + 1) % len(tok)] for r in greedy]
    responses = [greedy[i] if i % 2 else changed[i] for i in range(len(prompts))]
    masks = [[1] * 3 if i % 4 != 2 else [1, 1, 0] for i in range(len(prompts))]
    mb = make_micro_batch(prompts, responses, masks, tok.pad_token_id)
    got = greedy_matches(model, mb).tolist()
    assert got == [i % 2 == 1 or i % 4 == 2 for i in range(len(prompts))]


def _constant_answer_examples(tok, n: int):
    return [answer_example(tok, p, "7") for p in _prompts(tok, n, seed=1)]


def test_a_target_accuracy_ends_the_warm_start_once_the_probe_reaches_it():
    tok = build_char_tokenizer()
    examples = _constant_answer_examples(tok, 200)
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    result = warm_start(model, tok, examples, 300, 0.01, 16, seed=0, target_accuracy=0.9)
    assert result.probe_accuracy is not None and result.probe_accuracy >= 0.9
    assert 0 < result.steps < 300 and result.steps % CHECK_EVERY == 0
    # The policy it leaves answers the held-out kind of prompt as taught.
    x = torch.tensor(_prompts(tok, 8, seed=9))
    with torch.no_grad():
        out = model.eval().generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=2, do_sample=False,
            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        )  # fmt: skip
    answers = tok.batch_decode(out[:, x.shape[1] :], skip_special_tokens=True)
    assert sum(a == "7" for a in answers) >= 7

    # Without a target it trains every step, and a target out of reach stops at the most.
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    assert warm_start(model, tok, examples, 25, 0.01, 16, seed=0).steps == 25
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    short = warm_start(model, tok, examples, 3, 1e-6, 16, seed=0, target_accuracy=1.0)
    assert short.steps == 3 and short.probe_accuracy is not None and short.probe_accuracy < 1.0


class _Recording(list):
    """A list of examples that records which indices are read, in order."""

    def __init__(self, items):
        super().__init__(items)
        self.reads: list[int] = []

    def __getitem__(self, i):
        self.reads.append(i)
        return super().__getitem__(i)


def test_the_probe_is_held_out_of_the_training_batches():
    tok = build_char_tokenizer()
    examples = _Recording(_constant_answer_examples(tok, 100))
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    warm_start(model, tok, examples, 40, 0.01, 16, seed=0, target_accuracy=1.0)
    # The probe's rows are read first, three times (prompt, response, mask) each; then only
    # training rows.
    probe = set(examples.reads[: 3 * 10])
    trained = set(examples.reads[3 * 10 :])
    assert len(probe) == 10 and len(trained) > 50
    assert not probe & trained


def test_too_few_examples_for_a_probe_are_refused():
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    with pytest.raises(ValueError, match="too few to hold out a probe"):
        warm_start(model, tok, _constant_answer_examples(tok, 9), 5, 0.01, 4, 0, None, 0.5)


def test_the_config_check_refuses_a_target_that_is_not_a_share():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"warm_start": {"steps": 100, "target_accuracy": 1.5}})
    assert "warm_start.target_accuracy: must be in [0, 1], got 1.5" in str(info.value)
    # steps 0 is no warm start, whatever the target (a config derived from one with a target).
    assert config_from_dict({"warm_start": {"steps": 0, "target_accuracy": 0.2}})


def test_a_policy_without_a_target_keeps_its_cache_key():
    base = config_from_dict({"warm_start": {"steps": 150}})
    same = config_from_dict({"warm_start": {"steps": 150, "target_accuracy": 0.0}})
    other = config_from_dict({"warm_start": {"steps": 150, "target_accuracy": 0.2}})
    assert PolicySpec.of(base).key() == PolicySpec.of(same).key() != PolicySpec.of(other).key()
    cold = config_from_dict({"warm_start": {"steps": 0}})
    cold_target = config_from_dict({"warm_start": {"steps": 0, "target_accuracy": 0.2}})
    assert PolicySpec.of(cold).key() == PolicySpec.of(cold_target).key()


def test_a_bf16_warm_start_trains_float32_weights_and_leaves_the_attention_as_it_was():
    """warm_start with matmul_dtype: the loss falls as in float32, the weights stay float32, the
    model names its own attention afterwards (what a saved policy's config says), and the steps
    differ from a float32 warm start's only by rounding (same batches, close losses)."""
    tok = build_char_tokenizer()
    examples = _constant_answer_examples(tok, 200)
    runs = {}
    for dtype in (None, torch.bfloat16):
        model = build_tiny_qwen3(SMALL, len(tok), seed=0)
        before = model.config._attn_implementation
        runs[dtype] = warm_start(model, tok, examples, 30, 0.01, 16, seed=0, matmul_dtype=dtype)
        assert model.config._attn_implementation == before
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    f32, bf16 = runs[None].losses, runs[torch.bfloat16].losses
    assert bf16[-1] < bf16[0] / 2
    assert f32 != bf16  # bf16 matmuls round differently...
    assert max(abs(a - b) for a, b in zip(f32[:5], bf16[:5], strict=True)) < 0.05  # ...only


def test_the_weakest_length_is_read_among_the_lengths_a_tenth_of_the_probe_holds():
    lengths = torch.tensor([2] * 12 + [3] * 7 + [4])
    hits = torch.tensor([True] * 9 + [False] * 3 + [True] * 2 + [False] * 5 + [False])
    # Length 4 (one row of 20) is too rare to count; length 3 is right 2 times of 7.
    assert weakest_length_accuracy(hits, lengths) == pytest.approx(2 / 7)
    # No length common enough: the share over all rows.
    many = torch.arange(20)
    assert weakest_length_accuracy(hits, many) == pytest.approx(11 / 20)


def _two_form_examples(tok, n: int):
    """Prompts whose first digit is 8 or 9 (a fifth) answer "123", the others "7"."""
    prompts = _prompts(tok, n, seed=1)
    return [answer_example(tok, p, "123" if tok.decode(p[:1]) in "89" else "7") for p in prompts]


def test_a_per_length_target_trains_on_until_the_long_answers_reach_it_too():
    """The short answer alone meets a 0.75 target on the whole probe; held per length, the warm
    start goes on until the long answers are right that often as well."""
    tok = build_char_tokenizer()
    examples = _two_form_examples(tok, 400)
    # New prompts of the long form, to read greedy accuracy on after each warm start.
    fresh = [p for p in _prompts(tok, 400, seed=5) if tok.decode(p[:1]) in "89"]
    rows = [answer_example(tok, p, "123") for p in fresh]
    mb = make_micro_batch(*map(list, zip(*rows, strict=True)), tok.pad_token_id)
    runs = {}
    for per_length in (False, True):
        model = build_tiny_qwen3(SMALL, len(tok), seed=0)
        result = warm_start(
            model, tok, examples, 600, 0.01, 16, seed=0, target_accuracy=0.75,
            target_per_length=per_length,
        )  # fmt: skip
        with torch.no_grad():
            runs[per_length] = (result, float(greedy_matches(model.eval(), mb).float().mean()))
    (whole, long_whole), (each, long_each) = runs[False], runs[True]
    assert whole.steps < each.steps < 600
    assert each.probe_accuracy is not None and each.probe_accuracy >= 0.75
    assert long_whole < 0.5 <= long_each


def test_a_per_length_target_needs_a_target_and_keys_the_policy_only_with_one():
    with pytest.raises(ConfigError) as info:
        config_from_dict({"warm_start": {"steps": 100, "target_per_length": True}})
    assert "warm_start.target_per_length" in str(info.value)
    target = {"steps": 150, "target_accuracy": 0.2}
    whole = config_from_dict({"warm_start": target})
    each = config_from_dict({"warm_start": {**target, "target_per_length": True}})
    assert PolicySpec.of(whole).key() != PolicySpec.of(each).key()
    cold = config_from_dict({"warm_start": {"steps": 0}})
    cold_each = config_from_dict({"warm_start": {"steps": 0, "target_per_length": True}})
    assert PolicySpec.of(cold).key() == PolicySpec.of(cold_each).key()
