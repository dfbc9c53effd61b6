"""The pure parts of the Megatron backend's loading, data-parallel split and settings: each
Megatron tensor built from only the HF tensors it needs (from memory or safetensors, either
expert layout), micro-batches shared out over data-parallel ranks, sequence parallel fitted to
the layer spec, and the MoE aux loss off for RL. megatron-core is not needed."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3MoeConfig

from relax_core.config import load_config
from relax_core.train.data_parallel import dp_share
from relax_core.train.megatron.assemble import hf_sources, mcore_tensor_from_hf
from relax_core.train.megatron.checkpoint import SafetensorsCheckpoint, state_reader
from relax_core.train.megatron.config import (
    MegatronParallel,
    fit_to_layer_spec,
    transformer_config_kwargs,
)
from relax_core.train.megatron.convert import hf_to_megatron
from relax_core.train.megatron.names import Dims
from tests.unit.test_megatron_convert import SIZES, dense, moe

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _per_expert(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused expert tensors as the per-expert names checkpoints hold."""
    read = state_reader(hf_state)
    out = {}
    for name, tensor in hf_state.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            prefix, kind = name.rsplit(".", 1)
            parts = ("gate", "up") if kind == "gate_up_proj" else ("down",)
            for e in range(tensor.shape[0]):
                for part in parts:
                    key = f"{prefix}.{e}.{part}_proj.weight"
                    out[key] = read(key).clone()
        else:
            out[name] = tensor
    return out


@pytest.mark.parametrize("spec", ["local", "te"])
@pytest.mark.parametrize("kind", ["dense-tied", "dense", "moe"])
def test_each_megatron_tensor_assembles_as_the_whole_conversion(kind, spec):
    config, hf_state = moe(mlp_only_layers=[1]) if kind == "moe" else dense(kind == "dense-tied")
    expected = hf_to_megatron(hf_state, config, spec=spec)
    dims = Dims.from_hf(config)
    for state in (hf_state, _per_expert(hf_state)):  # either expert layout in memory
        read = state_reader(state)
        for name, tensor in expected.items():
            assert torch.equal(mcore_tensor_from_hf(name, read, dims, spec), tensor), name


def test_an_expert_tensor_reads_that_expert_only():
    config, _ = moe()
    dims = Dims.from_hf(config)
    name = "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"
    assert hf_sources(name, dims, "local") == [
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    ]
    assert hf_sources("decoder.layers.0.mlp.experts.linear_fc2.weight2", dims, "te") == [
        "model.layers.0.mlp.experts.2.down_proj.weight"
    ]


def test_missing_and_misshapen_hf_tensors_are_named():
    config, hf_state = dense(tied=False)
    dims = Dims.from_hf(config)
    state = dict(hf_state)
    del state["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match=r"no tensor 'model.layers.1.self_attn.k_proj.weight'"):
        mcore_tensor_from_hf(
            "decoder.layers.1.self_attention.linear_qkv.weight", state_reader(state), dims, "local"
        )
    state["model.norm.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(64,\)"):
        mcore_tensor_from_hf("decoder.final_layernorm.weight", state_reader(state), dims, "local")
    with pytest.raises(ValueError, match="unknown Megatron tensor 'decoder.layers.1.mlp.router"):
        mcore_tensor_from_hf("decoder.layers.1.mlp.router.weight", state_reader(state), dims, "te")


@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_safetensors_checkpoint_reads_per_expert_names_in_either_layout(tmp_path, layout):
    config, hf_state = moe()
    on_disk = _per_expert(hf_state) if layout == "per-expert" else hf_state
    items = sorted(on_disk.items())
    half = len(items) // 2  # two shards and the index transformers writes
    save_file({n: t.contiguous() for n, t in items[:half]}, str(tmp_path / "a.safetensors"))
    save_file({n: t.contiguous() for n, t in items[half:]}, str(tmp_path / "b.safetensors"))
    weight_map = {n: "a.safetensors" for n, _ in items[:half]}
    weight_map.update({n: "b.safetensors" for n, _ in items[half:]})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    checkpoint = SafetensorsCheckpoint(str(tmp_path))
    for name, tensor in _per_expert(hf_state).items():
        assert torch.equal(checkpoint(name), tensor), name
    with pytest.raises(KeyError):
        checkpoint("model.layers.0.mlp.experts.9.up_proj.weight")
    checkpoint.close()


def test_a_directory_without_weights_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no HF safetensors weights"):
        SafetensorsCheckpoint(str(tmp_path))


@pytest.mark.parametrize(("n", "size"), [(0, 2), (1, 4), (5, 1), (7, 3), (8, 4), (10, 4)])
def test_dp_share_gives_every_micro_batch_to_exactly_one_rank(n, size):
    shares = [dp_share(n, rank, size) for rank in range(size)]
    taken = sorted(i for share in shares for i in share.indices)
    assert taken == list(range(n))
    rounds = -(-n // size)  # ceil(n / size): every rank runs as many forwards
    assert all(share.rounds == rounds for share in shares)
    assert sum(share.padding for share in shares) == rounds * size - n
    assert shares[0].indices == tuple(range(0, n, size))


def test_dp_share_example_and_errors():
    # 7 micro-batches over 3 ranks: 0,3,6 | 1,4 + 1 padding | 2,5 + 1 padding
    assert [(s.indices, s.padding) for s in (dp_share(7, r, 3) for r in range(3))] == [
        ((0, 3, 6), 0),
        ((1, 4), 1),
        ((2, 5), 1),
    ]
    with pytest.raises(ValueError, match="bad data-parallel rank 3 of size 3"):
        dp_share(7, 3, 3)


def test_sequence_parallel_is_turned_off_on_the_local_spec_with_a_message():
    config, _ = dense(tied=False)
    asked = MegatronParallel(tp=2, sequence_parallel=True)
    fitted, note = fit_to_layer_spec(asked, "local", config)
    assert fitted == MegatronParallel(tp=2, sequence_parallel=False)
    assert "train.parallel.sequence_parallel" in note and "TransformerEngine" in note
    assert fit_to_layer_spec(asked, "te", config) == (asked, "")
    assert fit_to_layer_spec(fitted, "local", config) == (fitted, "")


def test_moe_with_tensor_parallel_on_the_local_spec_is_refused():
    config, _ = moe()
    with pytest.raises(ValueError, match="train.parallel.tensor: 2 with an MoE policy"):
        fit_to_layer_spec(MegatronParallel(tp=2, ep=2), "local", config)
    assert fit_to_layer_spec(MegatronParallel(ep=2), "local", config)[1] == ""


def test_the_shipped_moe_config_trains_on_the_local_spec():
    cfg = load_config(os.path.join(REPO, "configs", "qwen3-30b-a3b-moe-r3.yaml"))
    p = cfg.train.parallel
    parallel = MegatronParallel(  # as train/factory.py builds it
        tp=p.tensor, pp=p.pipeline, cp=p.context, ep=p.expert,
        sequence_parallel=p.sequence_parallel and p.tensor > 1,
        distributed_optimizer=p.distributed_optimizer,
    )  # fmt: skip
    qwen3_30b_a3b = Qwen3MoeConfig(  # the shapes of Qwen/Qwen3-30B-A3B's config.json
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, router_aux_loss_coef=0.001,
    )  # fmt: skip
    parallel.check_model(qwen3_30b_a3b)
    assert fit_to_layer_spec(parallel, "local", qwen3_30b_a3b) == (parallel, "")
    kwargs = transformer_config_kwargs(qwen3_30b_a3b, parallel, routing_replay=True)
    assert kwargs["moe_aux_loss_coeff"] == 0.0  # not the config's pretraining 0.001


def test_moe_aux_loss_is_off_unless_asked():
    config = Qwen3MoeConfig(
        **SIZES, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        router_aux_loss_coef=0.001,
    )  # fmt: skip
    off = transformer_config_kwargs(config, MegatronParallel())
    assert off["moe_aux_loss_coeff"] == 0.0 and off["moe_router_load_balancing_type"] == "none"
    assert off["moe_z_loss_coeff"] is None
    # Gradients are summed over data-parallel ranks (each rank's loss is its share of the step).
    assert off["calculate_per_token_loss"] is True
    on = transformer_config_kwargs(config, MegatronParallel(), moe_aux_loss_coeff=0.01)
    assert on["moe_aux_loss_coeff"] == 0.01 and on["moe_router_load_balancing_type"] == "aux_loss"
    with pytest.raises(ValueError, match="moe_aux_loss_coeff must be >= 0"):
        transformer_config_kwargs(config, MegatronParallel(), moe_aux_loss_coeff=-1.0)
