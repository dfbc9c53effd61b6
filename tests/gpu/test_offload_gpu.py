"""train.offload_between_steps on a GPU: while the engine would generate, the torch allocator
gives back the trainer's weights, gradients and AdamW moments (the CPU proxy,
offload.resident_bytes, reads 0), and the trainer trains as one that keeps its state there (bf16 compute over float32
master weights, to the kernels' own run-to-run rounding)."""

from __future__ import annotations

import pytest
import torch

from relax_core.config import ModelConfig, TrainConfig
from relax_core.models.tiny import build_tiny_qwen3
from relax_core.train.offload import colocate_turn_bytes
from relax_core.train.torch_backend import build_backend
from tests.unit.test_activation_checkpointing import _loss, _micro_batch

pytestmark = pytest.mark.gpu

SHAPE = ModelConfig(
    hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=1024
)


def _backend():
    model = build_tiny_qwen3(SHAPE, vocab_size=79, seed=0).to("cuda")
    return build_backend(model, TrainConfig(lr=1e-3), 1.0, compute_dtype=torch.bfloat16)


def test_offloading_gives_the_gpu_back_and_trains_the_same():
    mb = _micro_batch()
    turning = _backend()
    weights = 4 * sum(p.numel() for p in turning.model.parameters())  # float32
    losses, allocated = [], {}
    turning.offload()

    def train():
        losses.append(turning.train_step([mb], _loss)["loss"])
        allocated["train"] = torch.cuda.memory_allocated()

    for _ in range(2):
        phases = colocate_turn_bytes(turning, train)
        allocated["generate"] = torch.cuda.memory_allocated()
    assert phases["generate"] == {"params": 0, "grads": 0, "optimizer": 0}
    assert phases["update"] == {"params": weights, "grads": 0, "optimizer": 0}
    # What the allocator gave back: weights, gradients and both AdamW moments (cuBLAS
    # workspaces and buffers stay).
    assert allocated["train"] - allocated["generate"] >= 4 * weights, allocated

    kept = _backend()
    kept_losses = [kept.train_step([mb], _loss)["loss"] for _ in range(2)]
    turning.reload()
    torch.testing.assert_close(losses, kept_losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(kept.model.parameters(), turning.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
