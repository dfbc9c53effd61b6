"""model.matmul_dtype: bf16 linear layers on float32 weights. The engine's copy computes as the
trainer does under autocast (bit for bit on the same input), weight updates reach it, padding
stays masked, engine and trainer score sampled tokens alike, and the config refuses it where
it does not apply."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from relax_core.config import ConfigError, ModelConfig, load_config, replace
from relax_core.models.attention import FLOAT32_SDPA, use_float32_attention
from relax_core.models.precision import linear_layers_in
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.factory import make_backend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Grouped-query attention (4 query heads on 2 key/value heads) and a tied LM head, as SmolLM2.
SMALL = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)
BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _ids(tok, texts: list[str]) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _left_padded(tok, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


def _trainer_logits(model, ids, mask) -> torch.Tensor:
    """The trainer's forward: float32 weights, autocast to bf16, float32 attention."""
    trainer = copy.deepcopy(model)
    use_float32_attention(trainer)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        return trainer(input_ids=ids, attention_mask=mask).logits


def test_the_engine_copy_computes_as_the_trainer_bit_for_bit(tok):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine_model = linear_layers_in(copy.deepcopy(model), BF16)
    dtypes = {n: p.dtype for n, p in engine_model.named_parameters()}
    assert dtypes["model.layers.0.mlp.up_proj.weight"] == BF16
    assert dtypes["model.layers.0.input_layernorm.weight"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.float32  # tied: the LM head's too
    assert engine_model.config._attn_implementation == FLOAT32_SDPA
    ids, mask = _left_padded(tok, _ids(tok, ["12+34=", "5+6="]))
    with torch.no_grad():
        got = engine_model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, _trainer_logits(model, ids, mask))


def test_weight_updates_reach_every_layer_of_the_engine_copy(tok):
    """Weight sync copies float32 weights into the engine: its bf16 linear layers and the
    tied LM head's cast (refreshed when the shared weight changes) follow them."""
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine = TorchEngine(
        linear_layers_in(copy.deepcopy(model), BF16), tok.eos_token_id, tok.pad_token_id
    )
    ids, mask = _left_padded(tok, _ids(tok, ["12+34=", "5+6="]))
    with torch.no_grad():
        engine.model(input_ids=ids, attention_mask=mask)  # the LM head casts the old weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(model.named_parameters(), version=1)
    with torch.no_grad():
        got = engine.model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(got, _trainer_logits(model, ids, mask))


def test_padding_stays_masked(tok):
    """The float32 attention is registered with SDPA's mask: a left-padded row reads as the row
    alone (bf16 matmuls of another batch shape differ in rounding only); attending to its
    padding would move it by far more."""
    model = linear_layers_in(build_tiny_qwen3(SMALL, len(tok), seed=0), BF16)
    short, long = _ids(tok, ["5+6=", "123+456="])
    ids, mask = _left_padded(tok, [short, long])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([short])).logits[0, -1].float()
        padded = model(input_ids=ids, attention_mask=mask).logits[0, -1].float()
        unmasked = model(input_ids=ids).logits[0, -1].float()
    assert (padded - alone).abs().max() < 0.02 < (unmasked - alone).abs().max()


def _cfg(**sections):
    return replace(load_config(os.path.join(REPO, "configs", "cpu-default.yaml")), **sections)


def test_engine_and_trainer_score_sampled_tokens_alike(tok):
    """The trainer (make_backend under matmul_dtype: autocast, float32 attention, float32
    weights published) scores the engine's samples to within bf16 rounding of other shapes."""
    cfg = _cfg(model={"matmul_dtype": "bfloat16"})
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine = TorchEngine(
        linear_layers_in(copy.deepcopy(model), BF16), tok.eos_token_id, tok.pad_token_id, seed=3
    )
    backend = make_backend(model, cfg)
    assert {t.dtype for _, t in backend.named_weights()} == {torch.float32}
    assert model.config._attn_implementation == FLOAT32_SDPA
    prompts = _ids(tok, ["1+2=", "40+2=", "1+2=", "7*8=", "40+2=", "1+2="])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    responses = [c.response_ids for c in outs]
    mb = make_micro_batch(
        prompts, responses, [[1] * len(r) for r in responses], tok.pad_token_id, share_prompts=True
    )
    (logp,) = backend.logprobs([mb])
    gap = torch.cat(
        [logp[i, : len(c.logprobs)] - torch.tensor(c.logprobs) for i, c in enumerate(outs)]
    )
    assert gap.abs().max() < 0.02 and gap.mean().abs() < 0.005


def _repeated_heads(module, query, key, value, attention_mask, **kwargs):
    """transformers' own SDPA path in float32 (key/value heads repeated for their query heads):
    what the float32 attention computed before it took grouped-query attention in one call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = (
        attention_mask.float()
        if attention_mask is not None and attention_mask.is_floating_point()
        else attention_mask
    )
    with torch.autocast(query.device.type, enabled=False):
        out, _ = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), mask, **kwargs
        )
    return out.to(query.dtype), None


def test_grouped_query_attention_with_a_mask_matches_repeated_heads_bit_for_bit(tok, monkeypatch):
    """A training step over padded rows of a GQA policy (4 query heads on 2 key/value heads):
    the float32 attention's one SDPA call per layer gives the log-probs and gradients that
    repeating each key/value head gives, to the bit, and it is the path those masked calls take."""
    from transformers import AttentionInterface

    import relax_core.models.attention as attention
    import relax_core.train.shared_prompts as shared_prompts

    # The padded response pass, whose masked calls these are (the packed one lays its tokens
    # out the same way: tests/unit/test_packed_responses.py).
    monkeypatch.setattr(shared_prompts, "_packs", lambda *_: False)
    # SDPA's one call, not the batched products small calls take (test_small_attention.py).
    monkeypatch.setattr(attention, "SMALL_ATTENTION", 0)
    AttentionInterface.register("sdpa_float32_repeated", _repeated_heads)
    AttentionMaskInterface.register("sdpa_float32_repeated", sdpa_mask)
    cfg = _cfg(model={"matmul_dtype": "bfloat16"})
    prompts = _ids(tok, ["1+2=", "40+2=", "1+2=", "7*8=", "40+2=", "1+2="])
    responses = _ids(tok, ["3", "42", "12", "56\n", "4", "3  "])
    mb = make_micro_batch(
        prompts, responses, [[1] * len(r) for r in responses], tok.pad_token_id, share_prompts=True
    )
    grouped = []
    real_sdpa = attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        grouped.append(kwargs.get("enable_gqa", False) and kwargs.get("attn_mask") is not None)
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    results = []
    for implementation in (FLOAT32_SDPA, "sdpa_float32_repeated"):
        model = build_tiny_qwen3(SMALL, len(tok), seed=0)
        backend = make_backend(model, cfg)
        model.set_attn_implementation(implementation)
        with torch.autocast("cpu", dtype=BF16):
            logp, _ = backend.scorer(mb, 1.0, False)
        (logp * mb.loss_mask).sum().backward()
        results.append((logp.detach(), [p.grad for p in model.parameters()]))
    (fast, fast_grads), (repeated, repeated_grads) = results
    assert any(grouped), "no masked grouped-query call took the one-call path"
    assert torch.equal(fast, repeated)
    assert all(torch.equal(a, b) for a, b in zip(fast_grads, repeated_grads, strict=True))


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"model": {"dtype": "bfloat16"}},
            "bf16 matmuls on float32 weights; with model.dtype 'bfloat16'",
        ),
        ({"model": {"kind": "tiny-omni"}}, "needs a text policy"),
        ({"model": {"matmul_dtype": "float16"}}, "'float16' is not one of , bfloat16, auto"),
        ({"rollout": {"engine": "sglang"}}, "needs rollout.engine torch, train.backend torch"),
        ({"train": {"lora": {"rank": 8}}}, "needs rollout.engine torch, train.backend torch"),
    ],
)
@pytest.mark.parametrize("value", ["bfloat16", "auto"])
def test_the_config_refuses_it_where_it_does_not_apply(sections, expected, value):
    """'auto' is refused where 'bfloat16' is: on the machines that pick bf16 it would not apply."""
    model = {"matmul_dtype": value, **sections.get("model", {})}
    others = {k: v for k, v in sections.items() if k != "model"}
    with pytest.raises(ConfigError, match=re.escape(f"model.matmul_dtype: {expected}")):
        _cfg(model=model, **others)


@pytest.mark.parametrize(
    ("text", "lacks"),
    [
        ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n", False),
        ("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_bf16 amx_tile\n", False),
        ("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n", True),
        ("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n", False),  # ARM: cannot tell
    ],
)
def test_a_cpu_without_native_bf16_is_recognised_by_its_flags(tmp_path, text, lacks):
    from relax_core.models.precision import cpu_has_native_bf16, cpu_lacks_native_bf16

    (tmp_path / "cpuinfo").write_text(text)
    assert cpu_lacks_native_bf16(str(tmp_path / "cpuinfo")) is lacks
    assert cpu_lacks_native_bf16(str(tmp_path / "absent")) is False
    # 'auto' picks bf16 only where the flags say it is native: never where it cannot tell
    native = "sse2" in text and not lacks
    assert cpu_has_native_bf16(str(tmp_path / "cpuinfo")) is native
    assert cpu_has_native_bf16(str(tmp_path / "absent")) is False


@pytest.mark.parametrize("native", [True, False])
def test_auto_computes_in_bf16_only_where_it_is_native(monkeypatch, tok, native):
    """'auto' is bfloat16 on a machine with native bf16 and float32 elsewhere, in every place
    that reads the setting: the engine's copy, the trainer's autocast, the tracked tag."""
    import relax_core.models.precision as precision
    from relax_core.tracking.runs import run_tags_of

    monkeypatch.setattr(precision, "native_bf16", lambda: native)
    assert precision.resolve_matmul_dtype("auto") == ("bfloat16" if native else "")
    assert precision.resolve_matmul_dtype("bfloat16") == "bfloat16"  # named: as asked
    assert precision.resolve_matmul_dtype("") == ""
    engine_model = precision.computing_as_trainer(build_tiny_qwen3(SMALL, len(tok), seed=0), "auto")
    linears = [m for m in engine_model.modules() if isinstance(m, torch.nn.Linear)]
    assert {m.weight.dtype for m in linears} == {torch.bfloat16 if native else torch.float32}
    # decided float32, it keeps the float32 attention (packed training, batched decode)
    assert engine_model.config._attn_implementation == FLOAT32_SDPA
    plain = precision.computing_as_trainer(build_tiny_qwen3(SMALL, len(tok), seed=0), "")
    assert plain.config._attn_implementation != FLOAT32_SDPA  # '' is transformers' own
    with precision.trainer_autocast("cpu", "auto"):
        assert torch.is_autocast_enabled("cpu") is native
    tags = run_tags_of(_cfg(model={"matmul_dtype": "auto"}), "r")
    assert tags["relax.matmul_dtype"] == ("bfloat16" if native else "float32")
    assert "relax.matmul_dtype" not in run_tags_of(_cfg(model={"matmul_dtype": ""}), "r")


def test_preflight_warns_of_bf16_matmuls_on_a_cpu_without_native_bf16(monkeypatch, caplog):
    """A warning that names the setting and what to do; the run is not refused."""
    import relax_core.models.precision as precision
    from relax_core.run import lifecycle

    cfg = _cfg(model={"matmul_dtype": "bfloat16"})
    monkeypatch.setattr(precision, "cpu_lacks_native_bf16", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING", logger=lifecycle.__name__):
        lifecycle._warn_emulated_bf16(cfg)
        lifecycle._warn_emulated_bf16(_cfg(model={"matmul_dtype": ""}))  # float32: no warning
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "without native bf16" in warned[0]
    assert "'auto' computes in float32 on such a CPU" in warned[0]


def test_preflight_says_what_auto_decided(monkeypatch, caplog):
    import relax_core.models.precision as precision
    from relax_core.run import lifecycle

    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    monkeypatch.setattr(precision, "cpu_lacks_native_bf16", lambda: True)
    with caplog.at_level("INFO", logger=lifecycle.__name__):
        lifecycle._warn_emulated_bf16(_cfg(model={"matmul_dtype": "auto"}))
    said = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert said == [("INFO", "model.matmul_dtype: auto computes in float32 on this machine")]
