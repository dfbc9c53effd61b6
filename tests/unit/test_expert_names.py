"""Fused MoE experts (transformers 5's in-memory layout) become the per-expert checkpoint tensors
SGLang loads, exactly: the split of a real Qwen3-MoE's fused weights equals what transformers
writes to a checkpoint, and the layout matches the tensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from relax_core.config import ModelConfig
from relax_core.models.tiny import build_tiny_qwen3
from relax_core.pool.weights import checkpoint_specs
from relax_core.rollout.expert_names import checkpoint_names
from relax_core.sync.buckets import specs_of

MOE = ModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    num_experts=4,
    experts_per_token=2,
)


def test_split_experts_are_what_a_saved_checkpoint_holds(tmp_path):
    model = build_tiny_qwen3(MOE, 64, seed=0)
    model.save_pretrained(tmp_path)  # transformers writes the per-expert checkpoint names
    saved = load_file(str(tmp_path / "model.safetensors"))
    split = dict(checkpoint_names((n, p.detach()) for n, p in model.named_parameters()))
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in split
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in split)
    assert split.keys() == saved.keys()
    for name, tensor in saved.items():
        assert torch.equal(split[name], tensor), name


def test_layout_and_tensors_agree_and_dense_names_pass_through():
    model = build_tiny_qwen3(MOE, 64, seed=0)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    assert checkpoint_specs(specs_of(named)) == specs_of(checkpoint_names(named))
    dense = build_tiny_qwen3(ModelConfig(hidden_size=32, num_layers=1), 64, seed=0)
    named = [(n, p.detach()) for n, p in dense.named_parameters()]
    assert [n for n, _ in checkpoint_names(named)] == [n for n, _ in named]


def test_a_fused_tensor_of_the_wrong_rank_is_named():
    from relax_core.sync.buckets import TensorSpec

    with pytest.raises(ValueError, match="experts.down_proj: a fused expert tensor"):
        checkpoint_specs([TensorSpec("model.layers.0.mlp.experts.down_proj", (4, 8), "float32")])
