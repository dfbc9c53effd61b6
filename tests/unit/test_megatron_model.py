"""convert.py's names and shapes against a real megatron-core GPTModel, built on CPU.

Skipped where megatron-core is not installed. The GPTModel forward needs CUDA (rotary embeddings
move to the current CUDA device), so forward checks live in tests/gpu/test_megatron_backend.py.
"""

from __future__ import annotations

import pytest
import torch

from tests import needs

needs.module("megatron.core", "pip install -e '.[dev]' (megatron-core 0.16.1 on Python 3.11)")


from relax_core.train.megatron.config import MegatronParallel  # noqa: E402
from relax_core.train.megatron.convert import hf_to_megatron  # noqa: E402
from relax_core.train.megatron.logprobs import vocab_parallel_logprobs  # noqa: E402
from relax_core.train.megatron.model import build_gpt  # noqa: E402
from tests.unit.test_megatron_convert import dense, moe  # noqa: E402


def assert_loads_strict(hf_config, hf_state, spec="local"):
    model, _ = build_gpt(hf_config, MegatronParallel(), "float32", spec, 64, cpu_init=True)
    mcore = hf_to_megatron(hf_state, hf_config, spec=spec)
    expected = {
        k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("_extra_state")
    }
    assert {k: tuple(v.shape) for k, v in mcore.items()} == expected
    model.load_state_dict(mcore, strict=True)
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), mcore[name]), name


@pytest.mark.parametrize("tied", [True, False])
def test_dense_weights_load_strict(megatron_group, tied):
    assert_loads_strict(*dense(tied))


def test_moe_weights_load_strict(megatron_group):
    assert_loads_strict(*moe(mlp_only_layers=[1]))


def test_vocab_parallel_logprobs_match_log_softmax(megatron_group):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3))
    logprobs, entropy = vocab_parallel_logprobs(logits, targets, temperature=0.7)
    expected = torch.log_softmax(logits.detach() / 0.7, dim=-1)
    torch.testing.assert_close(logprobs, expected.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    torch.testing.assert_close(entropy, -(expected.exp() * expected).sum(-1))
    (logprobs.sum() + entropy.sum()).backward()  # both are differentiable
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
