"""HF <-> Megatron-core conversion for Qwen3 / Qwen3-MoE, TP sharding, and parallel validation.

Tiny transformers models on CPU; megatron itself is not needed (tests/unit/test_megatron_model.py
checks the names against a real GPTModel where megatron-core is installed).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from relax_core.train.megatron.config import (
    MegatronParallel,
    gpt_model_kwargs,
    transformer_config_kwargs,
)
from relax_core.train.megatron.convert import (
    gather_from_tp,
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_hf_named,
    merge_qkv,
    shard_for_tp,
)
from relax_core.train.megatron.names import Dims

SIZES = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def dense(tied: bool) -> tuple[Qwen3Config, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = Qwen3Config(**SIZES, tie_word_embeddings=tied)
    model = Qwen3ForCausalLM(config)
    return config, {n: p.detach() for n, p in model.named_parameters()}


def moe(mlp_only_layers: list[int] | None = None) -> tuple[Qwen3MoeConfig, dict]:
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        **SIZES,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=mlp_only_layers or [],
    )
    model = Qwen3MoeForCausalLM(config)
    # transformers 5 keeps experts fused: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]
    return config, {n: p.detach() for n, p in model.named_parameters()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("spec", ["te", "local"])
def test_dense_round_trip_is_exact(tied, spec):
    config, hf = dense(tied)
    mcore = hf_to_megatron(hf, config, spec=spec)
    assert ("output_layer.weight" in mcore) is not tied
    norm = (
        "self_attention.linear_qkv.layer_norm_weight" if spec == "te" else "input_layernorm.weight"
    )
    assert f"decoder.layers.1.{norm}" in mcore
    assert_same(megatron_to_hf(mcore, config), hf)


def test_tied_lm_head_alias_is_accepted_and_not_emitted():
    config, hf = dense(tied=True)
    with_alias = {**hf, "lm_head.weight": hf["model.embed_tokens.weight"]}  # as state_dict() has
    assert_same(megatron_to_hf(hf_to_megatron(with_alias, config), config), hf)


@pytest.mark.parametrize("grouped", [False, True])
def test_moe_round_trip_is_exact_in_both_expert_layouts(grouped):
    config, hf = moe(mlp_only_layers=[1])  # layer 0 sparse, layer 1 dense
    mcore = hf_to_megatron(hf, config, grouped_experts=grouped)
    expert = (
        "experts.linear_fc1.weight3" if grouped else "experts.local_experts.3.linear_fc1.weight"
    )
    assert f"decoder.layers.0.mlp.{expert}" in mcore
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in mcore
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in mcore
    assert_same(megatron_to_hf(mcore, config, fused_experts=True), hf)

    per_expert = megatron_to_hf(mcore, config)  # checkpoint / SGLang names
    gate_up = hf["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(per_expert["model.layers.0.mlp.experts.2.gate_proj.weight"], gate_up[2, :32])
    assert torch.equal(per_expert["model.layers.0.mlp.experts.2.up_proj.weight"], gate_up[2, 32:])
    assert_same(hf_to_megatron(per_expert, config, grouped_experts=grouped), mcore)


def test_qkv_layout_interleaves_per_query_group():
    # 4 heads, 2 kv groups, head_dim 1, hidden 1: q rows q0..q3, k rows k0 k1, v rows v0 v1.
    # Group 0 owns q0 q1, k0, v0; group 1 owns q2 q3, k1, v1. Megatron rows:
    #   [q0, q1, k0, v0, q2, q3, k1, v1]
    dims = Dims("qwen3", 1, 1, num_heads=4, num_query_groups=2, head_dim=1, ffn=1, vocab=1,
                tied=True)  # fmt: skip
    q = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    k = torch.tensor([[20.0], [21.0]])
    v = torch.tensor([[30.0], [31.0]])
    rows = merge_qkv(q, k, v, dims).flatten().tolist()
    assert rows == [10.0, 11.0, 20.0, 30.0, 12.0, 13.0, 21.0, 31.0]


def test_streaming_matches_dict_version():
    config, hf = moe()
    mcore = hf_to_megatron(hf, config)
    for fused in (False, True):
        streamed = list(megatron_to_hf_named(iter(mcore.items()), config, fused))
        assert len({name for name, _ in streamed}) == len(streamed)
        assert_same(dict(streamed), megatron_to_hf(mcore, config, fused))
    extra = [("decoder.layers.0.self_attention.linear_qkv._extra_state", torch.empty(0))]
    assert list(megatron_to_hf_named(iter(extra), config)) == []


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("which", ["dense", "moe"])
def test_tp_shard_then_gather_is_identity(tp, which):
    config, hf = dense(tied=False) if which == "dense" else moe()
    for name, tensor in hf_to_megatron(hf, config).items():
        shards = [shard_for_tp(name, tensor, tp, r, hf_config=config) for r in range(tp)]
        assert torch.equal(gather_from_tp(name, shards), tensor), name


def test_tp_shards_follow_megatron_rules():
    config, hf = dense(tied=False)
    mcore = hf_to_megatron(hf, config)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    # rank 1 of 2 holds query group 1 whole: its 2 q heads, k1, v1 (16 rows each)
    assert torch.equal(shard_for_tp(name, mcore[name], 2, 1), mcore[name][64:])
    fc1 = mcore["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate (128); up (128)]
    shard = shard_for_tp("decoder.layers.0.mlp.linear_fc1.weight", fc1, 2, 1)
    assert torch.equal(shard, torch.cat([fc1[64:128], fc1[192:256]]))
    proj = mcore["decoder.layers.0.self_attention.linear_proj.weight"]
    shard = shard_for_tp("decoder.layers.0.self_attention.linear_proj.weight", proj, 2, 0)
    assert torch.equal(shard, proj[:, :32])
    norm = mcore["decoder.final_layernorm.weight"]
    assert shard_for_tp("decoder.final_layernorm.weight", norm, 2, 1) is norm


def test_bad_names_and_shapes_are_named():
    config, hf = dense(tied=False)
    with pytest.raises(ValueError, match="model.layers.0.mlp.bogus.weight"):
        hf_to_megatron({**hf, "model.layers.0.mlp.bogus.weight": torch.zeros(1)}, config)
    bad = {**hf, "model.layers.1.self_attn.k_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj.weight.*\(16, 64\)"):
        hf_to_megatron(bad, config)
    missing = {k: v for k, v in hf.items() if k != "model.layers.1.self_attn.q_norm.weight"}
    with pytest.raises(ValueError, match="model.layers.1.self_attn.q_norm.weight"):
        hf_to_megatron(missing, config)
    mcore = hf_to_megatron(hf, config)
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.nope.weight"):
        megatron_to_hf({**mcore, "decoder.layers.0.mlp.nope.weight": torch.zeros(1)}, config)
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    with pytest.raises(ValueError, match=qkv):
        megatron_to_hf({**mcore, qkv: mcore[qkv][:-1]}, config)
    with pytest.raises(ValueError, match="decoder.layers.0.mlp.router.weight"):
        megatron_to_hf({**mcore, "decoder.layers.0.mlp.router.weight": torch.zeros(4, 64)}, config)
    with pytest.raises(ValueError, match="unknown Megatron tensor 'decoder.foo'"):
        shard_for_tp("decoder.foo", torch.zeros(2), 2, 0)
    with pytest.raises(ValueError, match="num_attention_heads \\(4\\) is not divisible by .* 3"):
        shard_for_tp(qkv, mcore[qkv], 3, 0, hf_config=config)


def test_unsupported_model_type_is_named():
    config, hf = dense(tied=True)
    config.model_type = "llama"
    with pytest.raises(ValueError, match="model_type is 'llama'"):
        hf_to_megatron(hf, config)


def test_parallel_validation_names_the_field():
    with pytest.raises(ValueError, match="MegatronParallel.tp must be an integer >= 1"):
        MegatronParallel(tp=0)
    with pytest.raises(ValueError, match="MegatronParallel.ep"):
        MegatronParallel(ep=-1)
    with pytest.raises(ValueError, match="sequence_parallel needs tp > 1"):
        MegatronParallel(sequence_parallel=True)
    dense_config, _ = dense(tied=True)
    moe_config, _ = moe()
    twelve_heads = Qwen3Config(**{**SIZES, "num_attention_heads": 12, "num_key_value_heads": 4})
    cases = [
        (MegatronParallel(tp=8), dense_config, r"tp=8 must divide num_attention_heads \(4\)"),
        (MegatronParallel(tp=6), twelve_heads, r"tp=6 must be a multiple or a divisor"),
        (MegatronParallel(pp=3), dense_config, r"pp=3 must divide num_hidden_layers \(2\)"),
        (MegatronParallel(ep=3), moe_config, r"ep=3 must divide num_experts \(4\)"),
        (MegatronParallel(ep=2), dense_config, r"ep=2 needs an MoE model"),
    ]
    for parallel, config, message in cases:
        with pytest.raises(ValueError, match=message):
            transformer_config_kwargs(config, parallel)


def test_transformer_config_kwargs_for_moe():
    config, _ = moe(mlp_only_layers=[1])
    kwargs = transformer_config_kwargs(config, MegatronParallel(tp=2, ep=2))
    assert kwargs["num_query_groups"] == 2 and kwargs["kv_channels"] == 16
    assert kwargs["normalization"] == "RMSNorm" and kwargs["qk_layernorm"]
    assert kwargs["num_moe_experts"] == 4 and kwargs["moe_router_topk"] == 2
    assert kwargs["moe_ffn_hidden_size"] == 32 and kwargs["moe_layer_freq"] == [1, 0]
    # norm_topk_prob=True: top-k then softmax over the k, which is HF's renormalized softmax
    assert kwargs["moe_router_pre_softmax"] is False
    assert kwargs["tensor_model_parallel_size"] == 2 and kwargs["expert_model_parallel_size"] == 2
    assert kwargs["bf16"] and kwargs["params_dtype"] == torch.bfloat16
    gpt = gpt_model_kwargs(config)
    assert gpt["rotary_base"] == 10000 and gpt["share_embeddings_and_output_weights"] is False
