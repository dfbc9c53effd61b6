"""model.float32_attention: a bfloat16 policy computes attention in float32 in the engine and the
trainer alike, still masks padding, and the config refuses it where it would not apply."""

from __future__ import annotations

import copy
import os
import re

import pytest
import torch

from relax_core.config import ConfigError, ModelConfig, load_config, replace
from relax_core.models.attention import FLOAT32_SDPA, use_float32_attention
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import TorchBackend

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Grouped-query attention (4 query heads on 2 key/value heads), as in SmolLM2.
SMALL = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)


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


def test_in_a_float32_policy_it_is_sdpa_exactly(tok):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    switched = copy.deepcopy(model)
    use_float32_attention(switched)
    assert copy.deepcopy(switched).config._attn_implementation == FLOAT32_SDPA  # copies keep it
    ids, mask = _left_padded(tok, _ids(tok, ["12+34=", "5+6="]))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        got = switched(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(expected, got)


def test_a_bfloat16_policy_with_it_computes_attention_in_float32_and_masks_padding(tok):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0).to(torch.bfloat16)
    use_float32_attention(model)
    seen: list[torch.dtype] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(query, *args, **kwargs):
        seen.append(query.dtype)
        return sdpa(query, *args, **kwargs)

    short, long = _ids(tok, ["5+6=", "123+456="])
    with torch.no_grad():
        alone = model(input_ids=torch.tensor([short])).logits[0, -1].float()
        ids, mask = _left_padded(tok, [short, long])
        torch.nn.functional.scaled_dot_product_attention = spy
        try:
            padded = model(input_ids=ids, attention_mask=mask).logits[0, -1].float()
        finally:
            torch.nn.functional.scaled_dot_product_attention = sdpa
        unmasked = model(input_ids=ids).logits[0, -1].float()
    assert seen == [torch.float32] * SMALL.num_layers
    # The padded row reads as the row alone (bfloat16 matmuls of another batch shape differ in
    # rounding only); attending to its padding would move it by far more.
    gap = (padded - alone).abs().max()
    assert gap < 0.02 < (unmasked - alone).abs().max()


def test_engine_and_trainer_score_alike_with_it(tok):
    """The engine (bfloat16 weights) samples; the trainer (float32 master weights, bfloat16
    autocast), both with float32 attention, scores the same tokens to within bfloat16 rounding."""
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    use_float32_attention(model)
    engine = TorchEngine(
        copy.deepcopy(model).to(torch.bfloat16), tok.eos_token_id, tok.pad_token_id, seed=3
    )
    prompts = _ids(tok, ["1+2=", "40+2=", "1+2=", "7*8=", "40+2=", "1+2="])
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    responses = [c.response_ids for c in outs]
    mb = make_micro_batch(
        prompts, responses, [[1] * len(r) for r in responses], tok.pad_token_id, share_prompts=True
    )
    backend = TorchBackend(model, lr=1e-3, compute_dtype=torch.bfloat16)
    (logp,) = backend.logprobs([mb])
    engine_logp = torch.zeros_like(logp)
    for i, c in enumerate(outs):
        engine_logp[i, : len(c.logprobs)] = torch.tensor(c.logprobs)
    gap = (engine_logp - logp)[mb.loss_mask > 0]
    assert gap.abs().max() < 0.02 and gap.mean().abs() < 0.005


@pytest.mark.parametrize(
    ("model", "sections", "expected"),
    [
        ({"dtype": "float32"}, {}, "attention is float32 already with model.dtype float32"),
        ({"dtype": "bfloat16", "kind": "tiny-omni"}, {}, "needs a text policy"),
        (
            {"dtype": "bfloat16"},
            {"rollout": {"engine": "sglang"}},
            "SGLang and Megatron compute attention in model.dtype",
        ),
    ],
)
def test_the_config_refuses_it_where_it_does_not_apply(model, sections, expected):
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    with pytest.raises(ConfigError, match=re.escape(f"model.float32_attention: {expected}")):
        replace(cfg, model={**model, "float32_attention": True}, **sections)
