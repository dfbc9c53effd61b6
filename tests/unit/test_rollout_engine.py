"""Torch rollout engine: batched KV-cache sampling must score tokens exactly as a full forward does."""

from __future__ import annotations

import pytest
import torch

from relax_core.config import ModelConfig
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.sampling import _top_p_filter, sample_tokens
from relax_core.rollout.torch_engine import TorchEngine

SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture
def engine(tok):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    return TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=1)


def _ids(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def test_logprobs_match_an_unpadded_full_forward(engine, tok):
    prompts = _ids(tok, ["1+2=", "12+34=", "99+99=", "7="])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.7))
    for p, c in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + c.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(engine.model(ids).logits[0] / 0.7, -1)
        expected = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(c.response_ids)]
        assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_greedy_output_does_not_depend_on_batch_neighbours(engine, tok):
    prompts = _ids(tok, ["3+4=", "45+45=", "1="])
    params = SamplingParams(max_new_tokens=4, greedy=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [c.response_ids for c in together] == [c.response_ids for c in alone]


def test_stop_on_eos_and_finish_reasons(tok):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    with torch.no_grad():  # all-zero logits: every token equally likely, EOS included
        model.lm_head.weight.zero_()
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    outs = engine.generate(_ids(tok, ["1+1="] * 256), SamplingParams(max_new_tokens=3))
    # With 79 equally likely tokens, P(no EOS in 3) = (78/79)^3 ~ 0.96: both endings occur.
    assert {c.finish_reason for c in outs} == {"stop", "length"}
    for c in outs:
        if c.finish_reason == "stop":
            assert c.response_ids[-1] == tok.eos_token_id
            assert tok.eos_token_id not in c.response_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.response_ids) == 3
            assert tok.eos_token_id not in c.response_ids


def test_same_seed_same_samples(tok):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    a = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=5)
    b = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=5)
    prompts = _ids(tok, ["12+30="] * 8)
    params = SamplingParams(max_new_tokens=4)
    assert [c.response_ids for c in a.generate(prompts, params)] == [
        c.response_ids for c in b.generate(prompts, params)
    ]


def test_update_weights_sets_version_and_changes_outputs(engine, tok):
    prompts = _ids(tok, ["5+5="])
    before = engine.generate(prompts, SamplingParams(max_new_tokens=3, greedy=True))[0]
    new = {n: torch.randn_like(p) for n, p in engine.model.named_parameters()}
    engine.update_weights(new.items(), version=3)
    after = engine.generate(prompts, SamplingParams(max_new_tokens=3, greedy=True))[0]
    assert after.policy_version == 3 and before.policy_version == 0
    assert after.logprobs != before.logprobs
    with pytest.raises(KeyError, match="no parameter 'nope'"):
        engine.update_weights([("nope", torch.zeros(1))], version=4)


def test_paused_engine_refuses_work(engine, tok):
    engine.pause()
    with pytest.raises(RuntimeError, match="paused"):
        engine.generate(_ids(tok, ["1="]), SamplingParams(max_new_tokens=1))
    engine.resume()
    assert engine.health()["paused"] is False


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # probs 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps 0.5 and 0.3 (mass before 0.3 is 0.5 < 0.7;
    # mass before 0.15 is 0.8 >= 0.7, so it and 0.05 are dropped).
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    assert _top_p_filter(probs, 0.7)[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])


def test_sampled_logprob_is_of_the_tempered_distribution():
    logits = torch.tensor([[2.0, 0.0]])
    tok, lp = sample_tokens(logits, temperature=2.0, top_p=1.0, greedy=True, generator=None)
    # softmax([1, 0]) = [e/(e+1), 1/(e+1)] -> log(e/(e+1)) = -0.31326
    assert tok.item() == 0 and lp.item() == pytest.approx(-0.313262, abs=1e-5)


def test_partial_rollout_continues_under_new_weights_from_the_same_prefix(tok):
    """A weight update between decode steps: the first token is scored by the old weights,
    every later one by the new weights given the same prefix (the rebuilt cache is exact)."""
    old = build_tiny_qwen3(SMALL, len(tok), seed=0)
    new = build_tiny_qwen3(SMALL, len(tok), seed=5)
    engine = TorchEngine(
        build_tiny_qwen3(SMALL, len(tok), seed=0), tok.eos_token_id, tok.pad_token_id, seed=1
    )
    polls = []

    def poll() -> bool:
        polls.append(engine.version)
        if len(polls) == 1:
            engine.update_weights(list(new.named_parameters()), 1)
            return True
        return False

    engine.weight_poll = poll
    prompts = _ids(tok, ["1+2=", "12+34=", "99+9="])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.8))
    assert len(polls) >= 1 and engine.version == 1
    for p, c in zip(prompts, outs, strict=True):
        assert c.policy_version == 0
        ids = torch.tensor([p + c.response_ids])
        with torch.no_grad():
            lp_old = torch.log_softmax(old(ids).logits[0] / 0.8, -1)
            lp_new = torch.log_softmax(new(ids).logits[0] / 0.8, -1)
        first = c.response_ids[0]
        assert c.logprobs[0] == pytest.approx(lp_old[len(p) - 1, first].item(), abs=1e-4)
        if len(c.response_ids) > 1:
            assert c.policy_version_max == 1
            later = [
                lp_new[len(p) - 1 + j, t].item() for j, t in enumerate(c.response_ids) if j > 0
            ]
            assert c.logprobs[1:] == pytest.approx(later, abs=1e-4)
        else:  # ended on its first token, before the update
            assert c.policy_version_max is None


def test_without_an_update_completions_name_one_version(engine, tok):
    engine.weight_poll = lambda: False
    outs = engine.generate(_ids(tok, ["1+2="]), SamplingParams(max_new_tokens=4))
    assert outs[0].policy_version == 0 and outs[0].policy_version_max is None


def test_rows_leaving_the_decode_batch_keep_every_logprob_right(tok):
    """Finished rows leave the decode batch and its KV cache once they are a quarter of it;
    the rows that go on must still see exactly their own prefix."""
    model = build_tiny_qwen3(SMALL, len(tok), seed=3)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=2)
    prompts = _ids(tok, ["1+2=", "12+34=", "99+99=", "7=", "5*5=", "100-1="] * 20)
    # Temperature 4 spreads the mass: EOS (1 of 79 tokens) ends rows at scattered steps.
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=40, temperature=4.0))
    stopped = sum(c.finish_reason == "stop" for c in outs)
    assert len(prompts) // 4 <= stopped < len(prompts)  # the batch shrank, and rows went on
    for p, c in zip(prompts, outs, strict=True):
        ids = torch.tensor([p + c.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0] / 4.0, -1)
        expected = [logp[len(p) - 1 + j, t].item() for j, t in enumerate(c.response_ids)]
        assert c.logprobs == pytest.approx(expected, abs=1e-4)


def test_a_padded_decode_batch_samples_what_an_exact_one_does(tok, monkeypatch):
    """On a CPU the shrunk decode batch is padded to 8 sizes an octave with a repeated row: the
    padding is never sampled, so the same seed draws the same tokens with the same log-probs (to
    float32 rounding: a matrix product of another row count may round a last bit otherwise)."""
    from relax_core.rollout import torch_engine

    model = build_tiny_qwen3(SMALL, len(tok), seed=3)
    prompts = _ids(tok, ["1+2=", "12+34=", "99+99=", "7=", "5*5=", "100-1="] * 20)
    params = SamplingParams(max_new_tokens=40, temperature=4.0)
    sizes = []
    real = torch_engine.bucket_length

    def recorded(n: int) -> int:
        sizes.append((n, real(n)))
        return real(n)

    def run(seed: int, sizes_of):
        monkeypatch.setattr(torch_engine, "bucket_length", sizes_of)
        engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=seed)
        return engine.generate(prompts, params)

    # Which seeds shrink the batch to a size off the buckets depends on the CPU's kernels: take
    # the first that does.
    for seed in range(2, 12):
        sizes.clear()
        padded = run(seed, recorded)
        if any(n != b for n, b in sizes):
            break
    assert any(n != b for n, b in sizes), sizes  # some shrunk batch was padded
    exact = run(seed, lambda n: n)
    assert [c.response_ids for c in padded] == [c.response_ids for c in exact]
    for a, b in zip(padded, exact, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=2e-6, rel=0)


def test_a_repeated_prompt_is_prefilled_once_and_generates_as_alone(engine, tok):
    prompts = _ids(tok, ["3+4=", "45+45=", "3+4=", "1=", "45+45=", "3+4="])
    params = SamplingParams(max_new_tokens=5, greedy=True)
    together = engine.generate(prompts, params)
    alone = [engine.generate([p], params)[0] for p in prompts]
    assert [c.response_ids for c in together] == [c.response_ids for c in alone]
    for a, b in zip(together, alone, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_sampled_tokens_follow_the_distribution_and_skip_zero_mass():
    # 40k draws over 5 tokens, one of them with no mass: frequencies within 4 standard errors
    # of the probabilities, the zero-mass token never drawn, the same draws for the same seed.
    probs = torch.tensor([0.5, 0.25, 0.0, 0.15, 0.1])
    logits = probs.clamp(min=1e-30).log().expand(40_000, 5)
    g = torch.Generator().manual_seed(3)
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=1.0, greedy=False, generator=g)
    freq = torch.bincount(tokens, minlength=5).double() / len(tokens)
    se = (probs.double() * (1 - probs.double()) / len(tokens)).sqrt()
    assert freq[2] == 0
    assert torch.all((freq - probs.double()).abs() <= 4 * se + 1e-12), freq
    again, _ = sample_tokens(logits, 1.0, 1.0, False, torch.Generator().manual_seed(3))
    assert torch.equal(tokens, again)


def test_top_p_sampling_draws_only_inside_the_nucleus():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(5_000, 4)
    g = torch.Generator().manual_seed(0)
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.7, greedy=False, generator=g)
    assert set(tokens.tolist()) == {0, 1}
