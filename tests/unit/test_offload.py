"""train.offload_between_steps on the torch backend, measured on a CPU with the CUDA-free proxy
(train/offload.resident_bytes: the bytes of the trainer's parameters, gradients and AdamW state
found on its training device). A trainer that takes the colocate turns (train, then update with
its weights only, then generate with nothing on the device) trains exactly as one that keeps
everything, and its checkpoints are the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from relax_core.config import ConfigError, ModelConfig, TrainConfig, load_config, replace
from relax_core.models.tiny import build_tiny_qwen3
from relax_core.plan.memory import trainer_offload
from relax_core.train.offload import colocate_turn_bytes, resident_bytes
from relax_core.train.torch_backend import OPTIMIZER_FILE, build_backend
from tests.unit.test_activation_checkpointing import _loss, _micro_batch

STEPS = 2
REPO = Path(__file__).resolve().parents[2]


def _backend():
    cfg = ModelConfig(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256
    )
    return build_backend(build_tiny_qwen3(cfg, vocab_size=79, seed=0), TrainConfig(lr=1e-2), 1.0)


def _resident(backend) -> dict[str, int]:
    return resident_bytes(backend.model, backend.optimizer, backend.device)


def _taking_turns(backend, mb) -> tuple[list[float], dict[str, list[dict[str, int]]]]:
    """STEPS colocate steps (train, update, generate: offload.colocate_turn_bytes), as a GPU
    trainer starts, with its state in host memory. Returns the losses and each phase's bytes."""
    losses, phases = [], {"train": [], "update": [], "generate": []}
    backend.offload()

    def train():
        losses.append(backend.train_step([mb], _loss)["loss"])

    for _ in range(STEPS):
        for phase, held in colocate_turn_bytes(backend, train).items():
            phases[phase].append(held)
    return losses, phases


def test_the_state_leaves_the_device_while_the_engine_generates_and_trains_the_same():
    mb = _micro_batch()
    kept, turning = _backend(), _backend()
    params = sum(p.numel() * p.element_size() for p in kept.model.parameters())
    kept_losses = [kept.train_step([mb], _loss)["loss"] for _ in range(STEPS)]
    losses, phases = _taking_turns(turning, mb)
    full = {
        "params": params,
        "grads": params,
        "optimizer": 2 * params + 4 * len(kept.optimizer.state),
    }
    for train, update, generate in zip(*phases.values(), strict=True):
        assert train == full == _resident(kept)
        assert update == {"params": params, "grads": 0, "optimizer": 0}
        assert generate == {"params": 0, "grads": 0, "optimizer": 0}
    assert losses == kept_losses
    turning.reload()
    for (name, a), (_, b) in zip(
        kept.model.named_parameters(), turning.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name
    for p, q in zip(kept.model.parameters(), turning.model.parameters(), strict=True):
        for key, value in kept.optimizer.state[p].items():
            assert torch.equal(value, turning.optimizer.state[q][key]), key


def test_a_checkpoint_saved_and_loaded_while_offloaded_is_the_one_kept_state_gives(tmp_path):
    mb = _micro_batch()
    kept, turning = _backend(), _backend()
    for backend in (kept, turning):
        backend.train_step([mb], _loss)
    turning.offload()
    kept.save(str(tmp_path / "kept"))
    turning.save(str(tmp_path / "turning"))
    assert _resident(turning)["params"] == 0  # saved from the host copies, not brought back
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("kept", "turning"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    a, b = (
        torch.load(tmp_path / d / OPTIMIZER_FILE, weights_only=True) for d in ("kept", "turning")
    )
    for i, state in a["state"].items():
        assert all(torch.equal(v, b["state"][i][k]) for k, v in state.items())

    # Built from the saved policy, as a resumed session builds it.
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "turning", dtype=torch.float32)
    resumed = build_backend(policy, TrainConfig(lr=1e-2), 1.0)
    resumed.offload()
    resumed.load(str(tmp_path / "turning"))
    assert _resident(resumed) == {"params": 0, "grads": 0, "optimizer": 0}
    resumed.reload()
    assert resumed.train_step([mb], _loss)["loss"] == kept.train_step([mb], _loss)["loss"]


def test_the_weights_cannot_be_read_while_they_are_in_host_memory():
    backend = _backend()
    backend.offload()
    with pytest.raises(RuntimeError, match="reload"):
        next(backend.named_weights())
    backend.reload()
    assert all(p.numel() > 0 for _, p in backend.named_weights())


def test_who_gives_the_gpu_back_and_what_the_config_refuses():
    colocate = load_config(REPO / "configs" / "qwen3-4b-8xgpu-colocate.yaml")
    assert trainer_offload(colocate, on_gpu=True)  # auto: trainer and engine share GPU 0
    assert not trainer_offload(colocate, on_gpu=False)  # a CPU: nothing to give back
    assert not trainer_offload(replace(colocate, train={"backend": "fsdp"}), on_gpu=True)
    assert not trainer_offload(load_config(REPO / "configs" / "qwen3-4b-8xgpu.yaml"), True)
    on_cpu = replace(
        load_config(REPO / "configs" / "cpu-default.yaml"), train={"offload_between_steps": "on"}
    )
    assert trainer_offload(on_cpu, on_gpu=False)  # asked for: measured on a CPU
    with pytest.raises(ConfigError, match="train.offload_between_steps: 'on' needs mode colocate"):
        replace(
            load_config(REPO / "configs" / "cpu-async.yaml"), train={"offload_between_steps": "on"}
        )
    with pytest.raises(ConfigError, match="'sometimes' is not one of auto, on, off"):
        replace(colocate, train={"offload_between_steps": "sometimes"})
