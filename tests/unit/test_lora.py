"""LoRA policies: only the adapter trains and travels, engines holding the synced adapter score
what the trainer scores, and a checkpoint is a standard base + adapter pair that resumes exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from relax_core.config import LoraConfig, ModelConfig
from relax_core.models import lora
from relax_core.models.policy import load_policy
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import TorchBackend, response_logprobs

SHAPE = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
LORA = LoraConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _policy(tok):
    return lora.for_run(build_tiny_qwen3(SHAPE, len(tok), seed=0), LORA)


def _batch(tok, engine):
    prompts = [tok(f"{a}+{a}=", add_special_tokens=False)["input_ids"] for a in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=5))
    return make_micro_batch(
        prompts,
        [o.response_ids for o in outs],
        [[1] * len(o.response_ids) for o in outs],
        tok.pad_token_id,
        {"advantages": [[(-1.0) ** i] * len(o.response_ids) for i, o in enumerate(outs)]},
    )


def _loss(logprobs, entropy, mb):
    return -(logprobs * mb.extras["advantages"] * mb.loss_mask).sum() / mb.loss_mask.sum(), {}


def test_only_the_adapter_trains_and_travels_and_the_engine_scores_what_the_trainer_does(tok):
    model = _policy(tok)
    base_before = {k: v.clone() for k, v in lora.base_state_dict(model).items()}
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=1)
    backend = TorchBackend(model, lr=1e-2)
    mb = _batch(tok, engine)
    for _ in range(3):
        backend.train_step([mb], _loss)

    sent = dict(backend.named_weights())
    assert sent and all(".lora_A." in n or ".lora_B." in n for n in sent)
    full = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in sent.values()) < 0.2 * full
    assert {len(s) for s in backend.optimizer.state.values()} and len(
        backend.optimizer.state
    ) == len(sent)  # optimizer state for the adapter only
    for key, tensor in lora.base_state_dict(model).items():
        assert torch.equal(tensor, base_before[key]), key  # the base is frozen
    assert any(t.abs().sum() > 0 for n, t in sent.items() if ".lora_B." in n)

    (trainer_logp,) = backend.logprobs([mb])
    (stale_logp,) = TorchBackend(engine.model, lr=1e-2).logprobs([mb])
    assert not torch.allclose(stale_logp, trainer_logp, atol=1e-4)  # the adapter moved it
    engine.update_weights(backend.named_weights(), 3)
    (engine_logp,) = TorchBackend(engine.model, lr=1e-2).logprobs([mb])
    torch.testing.assert_close(engine_logp, trainer_logp, rtol=0, atol=1e-6)


def test_a_checkpoint_is_base_plus_peft_adapter_and_resumes_exactly(tok, tmp_path):
    from peft import PeftModel

    model = _policy(tok)
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=1)
    mb = _batch(tok, engine)
    backend = TorchBackend(model, lr=1e-2)
    backend.train_step([mb], _loss)
    backend.save(str(tmp_path))
    tok.save_pretrained(str(tmp_path))

    base = load_file(str(tmp_path / "model.safetensors"))
    assert not any("lora_" in k or "base_layer" in k for k in base)
    # Standard base + adapter: transformers and peft load it as it is.
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    peft_model = PeftModel.from_pretrained(plain, str(tmp_path / lora.ADAPTER_DIR)).eval()
    (ours,) = backend.logprobs([mb])
    with torch.no_grad():
        theirs, _ = response_logprobs(peft_model, mb, 1.0)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)

    resumed_model, _ = load_policy(str(tmp_path))
    assert lora.is_lora(resumed_model)
    resumed = TorchBackend(resumed_model, lr=1e-2)
    resumed.load(str(tmp_path))
    backend.train_step([mb], _loss)
    resumed.train_step([mb], _loss)
    for (name, a), (_, b) in zip(backend.named_weights(), resumed.named_weights(), strict=True):
        assert torch.equal(a, b), name


def test_the_reference_is_the_base_with_adapters_off(tok):
    model = _policy(tok)
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=1)
    mb = _batch(tok, engine)
    base = build_tiny_qwen3(SHAPE, len(tok), seed=0)
    backend = TorchBackend(model, lr=1e-2)
    backend.train_step([mb], _loss)
    with lora.adapters_disabled(model):
        (off,) = backend.logprobs([mb])
    (base_logp,) = TorchBackend(base, lr=1e-2).logprobs([mb])
    torch.testing.assert_close(off, base_logp, rtol=0, atol=1e-6)
    assert all(p.requires_grad for n, p in model.named_parameters() if ".lora_" in n)


def test_targets_the_policy_lacks_are_named(tok):
    model = build_tiny_qwen3(SHAPE, len(tok), seed=0)
    with pytest.raises(ValueError, match="train.lora.target_modules: 'wq,wv' names no module"):
        lora.attach_lora(model, 4, 8.0, 0.0, "wq,wv")


def test_targets_that_reach_fused_moe_experts_are_refused():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    moe = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=32,
            moe_intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    # The default targets name the MLP projections, which a MoE holds as fused 3-D experts.
    with pytest.raises(ValueError, match=r"reaches the fused expert parameters \['down_proj'"):
        lora.attach_lora(moe, 4, 8.0, 0.0, "q_proj,v_proj,gate_proj,up_proj,down_proj")
    attention_only = Qwen3MoeForCausalLM(moe.config)
    lora.attach_lora(attention_only, 4, 8.0, 0.0, "q_proj,k_proj,v_proj,o_proj")
    assert lora.is_lora(attention_only)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"train": {"lora": {"rank": -1}}}, "train.lora.rank: must be >= 0"),
        ({"train": {"lora": {"rank": 8, "dropout": 1.0}}}, "train.lora.dropout: must be in [0, 1)"),
        ({"train": {"lora": {"rank": 8, "target_modules": " , "}}}, "name at least one module"),
        (
            {"train": {"lora": {"rank": 8}, "backend": "megatron"}},
            "train.lora: LoRA trains with train.backend 'torch' or 'fsdp', not 'megatron'",
        ),
        (
            {
                "train": {"lora": {"rank": 8}},
                "rollout": {"engine": "sglang"},
                "sglang": {"extra_args": "--dp-size 2"},
            },
            "sglang.extra_args: --dp-size 2 with train.lora: SGLang 0.5.23 loads adapters only",
        ),
        (
            {
                "train": {"lora": {"rank": 8, "target_modules": "q_proj"}},
                "rollout": {"engine": "sglang"},
            },
            "an attention adapter needs q_proj and v_proj",
        ),
        (
            {
                "train": {"lora": {"rank": 8, "target_modules": "fc1"}},
                "rollout": {"engine": "sglang"},
            },
            "train.lora.target_modules: fc1 with rollout.engine 'sglang'",
        ),
    ],
)
def test_lora_settings_are_checked_by_name(tmp_path, sections, message):
    import yaml

    from relax_core.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(sections))
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert message in str(err.value)
