"""bf16 policies train on float32 master weights: an RL-sized step reaches the weights the engines
receive, and a checkpoint resumes the master weights exactly."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from relax_core.config import ModelConfig
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.backend import MASTER_WEIGHTS_FILE
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import TorchBackend

SHAPE = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)
BF16 = torch.bfloat16
LR = 1e-6


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def rollout(tok):
    """A bf16 policy (float32 tensors holding bf16 values, as one loaded from a bf16
    checkpoint) and a batch it generated with advantages +-1."""
    model = build_tiny_qwen3(SHAPE, len(tok), seed=0).to(BF16)
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=3)
    prompts = [tok(f"{a}+{a * 3}=", add_special_tokens=False)["input_ids"] for a in range(8)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    mb = make_micro_batch(
        prompts,
        [o.response_ids for o in outs],
        [[1] * len(o.response_ids) for o in outs],
        tok.pad_token_id,
        {"advantages": [[(-1.0) ** i] * len(o.response_ids) for i, o in enumerate(outs)]},
    )
    return model, mb


def _loss(logprobs, entropy, mb):
    return -(logprobs * mb.extras["advantages"] * mb.loss_mask).sum() / mb.loss_mask.sum(), {}


def _engine_weights(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in backend.named_weights()}


def _moved(before: dict, after: dict) -> torch.Tensor:
    """Which weights differ, all tensors flattened into one bool vector."""
    return torch.cat([(before[n] != after[n]).flatten() for n in before])


def _changed_fraction(before: dict, after: dict) -> float:
    return _moved(before, after).float().mean().item()


def _train(backend: TorchBackend, mb, steps: int) -> None:
    for _ in range(steps):
        backend.train_step([mb], _loss)


@pytest.mark.slow
def test_a_1e6_step_changes_the_bf16_weights_engines_receive(rollout):
    bf16_model, mb = rollout
    master = TorchBackend(copy.deepcopy(bf16_model).float(), lr=LR, compute_dtype=BF16)
    plain = TorchBackend(copy.deepcopy(bf16_model), lr=LR)  # bf16 parameters under AdamW
    start = _engine_weights(plain)
    assert all(t.dtype == BF16 for t in _engine_weights(master).values())

    _train(master, mb, 1)
    _train(plain, mb, 1)
    one_master = _changed_fraction(start, _engine_weights(master))
    moved_one_plain = _moved(start, _engine_weights(plain))
    _train(master, mb, 9)
    _train(plain, mb, 9)
    ten_master = _changed_fraction(start, _engine_weights(master))
    moved_ten_plain = _moved(start, _engine_weights(plain))
    ten_plain = moved_ten_plain.float().mean().item()

    # One AdamW step moves each weight by about lr = 1e-6; a bf16 ulp of a weight near 0.02 is
    # 2**-13 = 1.2e-4, so bf16 parameters keep only the updates of weights near zero, while the
    # float32 master crosses a rounding boundary in ~1e-6 / 1.2e-4 of the others per step and
    # the updates add up over steps instead of rounding away each time.
    assert one_master > 0.003
    assert ten_master > 3 * one_master  # the updates accumulate (7x here) rather than stall
    assert ten_master > 4 * ten_plain
    # bf16 parameters stall: nine more steps move no weight the first step left in place (the
    # updates round away each time instead of adding up) ...
    assert not (moved_ten_plain & ~moved_one_plain).any()
    # ... and what moves at all is weights near zero, where half a bf16 step is under lr:
    # below 2**-11 (and at 2**-11 itself, towards zero) the step is 2**-19 = 1.9e-6, from
    # there up 2**-18 = 3.8e-6 or more, whose half is more than a 1e-6 update: it rounds back.
    magnitudes = torch.cat([t.abs().float().flatten() for t in start.values()])
    assert moved_ten_plain.any() and magnitudes[moved_ten_plain].max() <= 2**-11
    # What engines receive is exactly the master weights rounded to bf16.
    for name, param in master.model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(dict(master.named_weights())[name], param.detach().to(BF16))


def test_a_checkpoint_holds_the_bf16_policy_and_resumes_the_float32_master(rollout, tmp_path):
    bf16_model, mb = rollout
    backend = TorchBackend(copy.deepcopy(bf16_model).float(), lr=LR, compute_dtype=BF16)
    _train(backend, mb, 3)
    backend.save(str(tmp_path))

    policy = load_file(str(tmp_path / "model.safetensors"))
    assert {t.dtype for t in policy.values()} == {BF16}
    master = load_file(str(tmp_path / MASTER_WEIGHTS_FILE))
    assert set(master) == {n for n, _ in backend.model.named_parameters()}
    assert {t.dtype for t in master.values()} == {torch.float32}

    # A resumed trainer builds the model from the bf16 policy, then takes the master weights.
    resumed_model = copy.deepcopy(bf16_model).float()
    resumed_model.load_state_dict({k: v.float() for k, v in policy.items()}, strict=False)
    resumed = TorchBackend(resumed_model, lr=LR, compute_dtype=BF16)
    resumed.load(str(tmp_path))
    _train(backend, mb, 2)
    _train(resumed, mb, 2)
    for (name, a), (_, b) in zip(
        backend.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resuming_master_weights_without_the_file_names_it(rollout, tmp_path):
    bf16_model, mb = rollout
    backend = TorchBackend(copy.deepcopy(bf16_model).float(), lr=LR, compute_dtype=BF16)
    _train(backend, mb, 1)
    backend.save(str(tmp_path))
    (tmp_path / MASTER_WEIGHTS_FILE).unlink()
    resumed = TorchBackend(copy.deepcopy(bf16_model).float(), lr=LR, compute_dtype=BF16)
    with pytest.raises(FileNotFoundError, match=MASTER_WEIGHTS_FILE):
        resumed.load(str(tmp_path))
