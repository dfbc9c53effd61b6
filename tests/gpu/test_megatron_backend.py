"""MegatronBackend on one GPU (tp=1): log-probs match the HF model, a step lowers the loss, the
HF names it hands the weight sync are the HF weights (announced beforehand by weight_layout), a
backend loads from a policy directory, and a checkpoint restores the weights."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from relax_core.net import free_port  # noqa: E402
from relax_core.train.batch import make_micro_batch  # noqa: E402
from relax_core.train.megatron.backend import (  # noqa: E402
    MegatronBackend,
    build_megatron_backend,
)
from relax_core.train.megatron.config import MegatronParallel  # noqa: E402
from relax_core.train.torch_backend import response_logprobs  # noqa: E402
from tests.unit.test_megatron_convert import dense  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def setup():
    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    config, hf_state = dense(tied=False)
    backend = MegatronBackend(
        config, hf_state, MegatronParallel(tp=1), lr=1e-3, dtype="float32", max_sequence_length=64
    )
    return config, hf_state, backend


def batch():
    torch.manual_seed(1)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 3, 7)]
    responses = [torch.randint(0, 256, (n,)).tolist() for n in (4, 6, 2)]
    masks = [[1] * len(r) for r in responses]
    return make_micro_batch(prompts, responses, masks, pad_token_id=0)


def mean_nll(logprobs, entropy, mb):
    mask = mb.loss_mask.to(logprobs.device)
    loss = -(logprobs * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def test_logprobs_match_hf(setup):
    from transformers import Qwen3ForCausalLM

    config, hf_state, backend = setup
    hf = Qwen3ForCausalLM(config).eval()
    hf.load_state_dict(hf_state, strict=False)
    mb = batch()
    with torch.no_grad():
        expected, _ = response_logprobs(hf, mb, temperature=1.0)
    (got,) = backend.logprobs([mb])
    mask = mb.loss_mask.bool()
    torch.testing.assert_close(got[mask], expected[mask], atol=1e-3, rtol=0)


def test_named_weights_are_the_hf_weights(setup):
    _, hf_state, backend = setup
    named = {n: t.cpu() for n, t in backend.named_weights()}
    assert named.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(named[name], tensor), name


def test_weight_layout_announces_what_named_weights_yields(setup):
    _, _, backend = setup
    announced = list(backend.weight_layout())
    assert all(t.device.type == "meta" for _, t in announced)
    yielded = [(n, t.shape, t.dtype) for n, t in backend.named_weights()]
    assert [(n, t.shape, t.dtype) for n, t in announced] == yielded


def test_a_backend_loads_from_a_policy_directory(setup, tmp_path):
    from transformers import Qwen3ForCausalLM

    config, hf_state, _ = setup
    model = Qwen3ForCausalLM(config)
    model.load_state_dict(hf_state)
    model.save_pretrained(str(tmp_path))
    train = SimpleNamespace(lr=1e-3, weight_decay=0.0, grad_clip=1.0, warmup_steps=0)
    loaded = build_megatron_backend(str(tmp_path), train, 1.0, MegatronParallel(), "float32")
    named = {n: t.cpu() for n, t in loaded.named_weights()}
    assert named.keys() == hf_state.keys()
    for name, tensor in hf_state.items():
        assert torch.equal(named[name], tensor), name


def test_train_step_lowers_loss_and_checkpoint_restores(setup, tmp_path):
    _, _, backend = setup
    mb = batch()
    before = mean_nll(backend.logprobs([mb])[0], None, mb)[0].item()
    metrics = backend.train_step([mb], mean_nll)
    assert metrics["skipped_step"] == 0.0 and metrics["grad_norm"] > 0
    after = mean_nll(backend.logprobs([mb])[0], None, mb)[0].item()
    assert after < before

    backend.save(str(tmp_path))
    saved = {n: t.cpu().clone() for n, t in backend.named_weights()}
    assert (tmp_path / "model.safetensors.index.json").exists()
    backend.train_step([mb], mean_nll)
    backend.load(str(tmp_path))
    assert backend.steps == 1
    for name, tensor in backend.named_weights():
        assert torch.equal(tensor.cpu(), saved[name]), name
