"""Rollout routing replay in the Megatron backend (train/megatron/replay.py).

The index conversion is pure and runs everywhere. The router checks build a tiny MoE GPTModel on
CPU where megatron-core is installed; the router's forward moves its weight to CUDA, so they call
its `routing` on logits computed here (tests/gpu/test_megatron_replay_gpu.py runs the model).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig

from relax_core.train.megatron.config import MegatronParallel, transformer_config_kwargs
from relax_core.train.megatron.names import Dims
from relax_core.train.megatron.replay import router_topk_indices
from tests.unit.test_megatron_convert import SIZES, dense, moe

E, K = 4, 2  # experts, top-k
TWO_LAYERS = Dims(
    model_type="qwen3_moe",
    num_layers=2,
    hidden=64,
    num_heads=4,
    num_query_groups=2,
    head_dim=16,
    ffn=128,
    vocab=256,
    tied=False,
    num_experts=E,
    moe_ffn=32,
    moe_layers=(False, True),  # layer 0 dense (its slots hold 0), layer 1 MoE
)


def experts_of(layer1: list[list[tuple[int, int] | None]]) -> torch.Tensor:
    """[B, S, 2 * K] from layer 1's experts per row and position (None: no data, all zeros)."""
    out = torch.zeros(len(layer1), len(layer1[0]), 2 * K, dtype=torch.long)
    for b, row in enumerate(layer1):
        for s, pair in enumerate(row):
            if pair is not None:
                out[b, s, K:] = torch.tensor(pair)
    return out


# B=2 rows, S=3 positions; the last position of each row has no recorded experts.
ROWS = [
    [(1, 2), (3, 0), None],
    [(2, 3), (0, 1), None],
]


def test_tokens_are_sequence_major():
    # The router flattens [S, B, E] logits: token s * B + b is position s of row b (B=2).
    #   token 0 = (s0, b0) -> (1, 2)    token 1 = (s0, b1) -> (2, 3)
    #   token 2 = (s1, b0) -> (3, 0)    token 3 = (s1, b1) -> (0, 1)
    #   token 4 = (s2, b0) -> no data -> (0, 1)   token 5 = (s2, b1) -> no data -> (0, 1)
    (layer1,) = router_topk_indices(experts_of(ROWS), (2, 3), TWO_LAYERS, K, MegatronParallel())
    assert layer1.dtype == torch.long
    assert layer1.tolist() == [[1, 2], [2, 3], [3, 0], [0, 1], [0, 1], [0, 1]]


def test_tensor_parallel_without_sequence_parallel_sees_every_token():
    full = router_topk_indices(experts_of(ROWS), (2, 3), TWO_LAYERS, K, MegatronParallel())
    for rank in (0, 1):
        got = router_topk_indices(
            experts_of(ROWS), (2, 3), TWO_LAYERS, K, MegatronParallel(tp=2), tp_rank=rank
        )
        assert torch.equal(got[0], full[0])


def test_sequence_parallel_pads_and_slices_the_sequence():
    # tp=2, S=3: the backend pads the sequence to 4, rank r routes positions [2r, 2r + 2).
    #   rank 0: s0, s1 -> tokens (s0,b0) (s0,b1) (s1,b0) (s1,b1) = (1,2) (2,3) (3,0) (0,1)
    #   rank 1: s2 (no data), s3 (padding) -> four tokens routed to (0, 1)
    parallel = MegatronParallel(tp=2, sequence_parallel=True)
    assert parallel.padded_length(3) == 4 and parallel.padded_length(4) == 4
    ranks = [
        router_topk_indices(experts_of(ROWS), (2, 3), TWO_LAYERS, K, parallel, tp_rank=r)[0]
        for r in (0, 1)
    ]
    assert ranks[0].tolist() == [[1, 2], [2, 3], [3, 0], [0, 1]]
    assert ranks[1].tolist() == [[0, 1]] * 4


def test_sequence_parallel_slices_a_single_row_in_order():
    # B=1, S=5, tp=2: padded to 6, rank 0 gets s0..s2, rank 1 gets s3, s4 and the pad s5.
    row = [[(0, 1), (1, 2), (2, 3), (3, 0), (3, 1)]]
    parallel = MegatronParallel(tp=2, sequence_parallel=True)
    rank0, rank1 = (
        router_topk_indices(experts_of(row), (1, 5), TWO_LAYERS, K, parallel, tp_rank=r)[0]
        for r in (0, 1)
    )
    assert rank0.tolist() == [[0, 1], [1, 2], [2, 3]]
    assert rank1.tolist() == [[3, 0], [3, 1], [0, 1]]


def test_only_moe_layers_get_indices():
    # decoder_sparse_step=2: layers 1 and 3 of 4 are MoE (transformers' rule); layer 3 is also
    # in mlp_only_layers here, so only layer 1 of 4 routes. Each token's slots are layer-major:
    # layer l's experts sit at [l * K, (l + 1) * K).
    config = Qwen3MoeConfig(
        **{**SIZES, "num_hidden_layers": 4},
        moe_intermediate_size=32,
        num_experts=E,
        num_experts_per_tok=K,
        decoder_sparse_step=2,
    )
    dims = Dims.from_hf(config)
    assert dims.moe_layers == (False, True, False, True)
    routed = torch.zeros(1, 2, 4 * K, dtype=torch.long)
    routed[0, :, 1 * K : 2 * K] = torch.tensor([[1, 3], [2, 0]])  # layer 1
    routed[0, :, 3 * K : 4 * K] = torch.tensor([[0, 2], [3, 1]])  # layer 3
    layer1, layer3 = router_topk_indices(routed, (1, 2), dims, K, MegatronParallel())
    assert layer1.tolist() == [[1, 3], [2, 0]]
    assert layer3.tolist() == [[0, 2], [3, 1]]
    config.mlp_only_layers = [3]
    (only,) = router_topk_indices(routed, (1, 2), Dims.from_hf(config), K, MegatronParallel())
    assert only.tolist() == [[1, 3], [2, 0]]


@pytest.mark.parametrize(
    "routed, shape, message",
    [
        (torch.zeros(2, 3, 3, dtype=torch.long), (2, 3), r"\[B, S, 2 \* 2\]"),
        (torch.zeros(2, 3 * 2 * K, dtype=torch.long), (2, 3), "expected"),
        (torch.zeros(2, 4, 2 * K, dtype=torch.long), (2, 3), "input_ids"),
        (torch.zeros(2, 3, 2 * K), (2, 3), "integer"),
    ],
)
def test_shape_and_dtype_errors(routed, shape, message):
    with pytest.raises(ValueError, match=message):
        router_topk_indices(routed, shape, TWO_LAYERS, K, MegatronParallel())


@pytest.mark.parametrize(
    "pair, message",
    [
        ((1, E), r"row 1, position 0, layer 1 .*outside 0\.\.3"),
        ((-1, 2), "outside"),
        ((2, 2), "repeats an expert"),
    ],
)
def test_bad_expert_ids_name_the_token(pair, message):
    rows = [[(0, 1), None], [pair, None]]
    with pytest.raises(ValueError, match=message):
        router_topk_indices(experts_of(rows), (2, 2), TWO_LAYERS, K, MegatronParallel())


def test_dense_model_and_bad_rank_are_rejected():
    config, _ = dense(tied=False)
    with pytest.raises(ValueError, match="dense"):
        router_topk_indices(
            torch.zeros(1, 2, 2 * K, dtype=torch.long),
            (1, 2),
            Dims.from_hf(config),
            K,
            MegatronParallel(),
        )
    with pytest.raises(ValueError, match="routing_replay needs an MoE model"):
        transformer_config_kwargs(config, MegatronParallel(), routing_replay=True)
    with pytest.raises(ValueError, match="tp_rank 2"):
        router_topk_indices(
            experts_of(ROWS), (2, 3), TWO_LAYERS, K, MegatronParallel(tp=2), tp_rank=2
        )


def test_config_enables_router_replay_only_when_asked():
    config, _ = moe(mlp_only_layers=[0])
    assert (
        transformer_config_kwargs(config, MegatronParallel())["moe_enable_routing_replay"] is False
    )
    on = transformer_config_kwargs(config, MegatronParallel(), routing_replay=True)
    assert on["moe_enable_routing_replay"] is True


# --- against megatron-core's routers (CPU) ---


def three_layer_moe() -> Qwen3MoeConfig:
    """Layers 0 dense, 1 and 2 MoE."""
    return Qwen3MoeConfig(
        **{**SIZES, "num_hidden_layers": 3},
        moe_intermediate_size=32,
        num_experts=E,
        num_experts_per_tok=K,
        norm_topk_prob=True,
        mlp_only_layers=[0],
        router_aux_loss_coef=0.0,
    )


def build(config: Qwen3MoeConfig, routing_replay: bool = True):
    from relax_core.train.megatron.model import build_gpt

    model, _ = build_gpt(
        config, MegatronParallel(), "float32", "local", 64, True, routing_replay=routing_replay
    )
    return model.eval()


def test_one_router_replay_per_moe_layer_in_order(megatron_group):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    from relax_core.train.megatron.replay import router_replays

    config = three_layer_moe()
    build(config)
    model = build(config)  # a second model: the global list holds only its routers
    replays = router_replays(model)
    routers = [model.decoder.layers[i].mlp.router for i in (1, 2)]
    assert replays == [r.router_replay for r in routers]
    assert len(set(map(id, replays))) == 2
    assert RouterReplay.global_router_replay_instances == replays
    assert router_replays(build(config, routing_replay=False)) == []


def test_replay_forward_routes_to_the_given_experts(megatron_group):
    from relax_core.train.megatron.replay import replaying, router_replays, router_topk_indices

    torch.manual_seed(0)
    config = three_layer_moe()
    model = build(config)
    router = model.decoder.layers[2].mlp.router
    B, S = 2, 3
    hidden = torch.randn(S, B, config.hidden_size)  # GPTModel's [S, B, H]
    # The router's gating (its forward moves the weight to CUDA): fp32 logits [S, B, E].
    logits = torch.nn.functional.linear(hidden, router.weight)
    own_probs, own_map = router.routing(logits)

    routed = torch.zeros(B, S, 3 * K, dtype=torch.long)
    for b in range(B):
        for s in range(S):
            pair = torch.randperm(E)[:K]
            routed[b, s, 1 * K : 2 * K] = pair
            routed[b, s, 2 * K : 3 * K] = (pair + 1) % E
    indices = router_topk_indices(routed, (B, S), Dims.from_hf(config), K, MegatronParallel())
    replays = router_replays(model)
    with replaying(replays, indices):
        probs, routing_map = router.routing(logits)
    # Token s * B + b goes to layer 2's experts of (b, s), weighted by the router's own
    # softmax over its logits at those experts (norm_topk_prob: top-k then softmax).
    flat = logits.reshape(S * B, E)
    for b in range(B):
        for s in range(S):
            token, chosen = s * B + b, routed[b, s, 2 * K : 3 * K]
            assert set(routing_map[token].nonzero().flatten().tolist()) == set(chosen.tolist())
            expected = torch.softmax(flat[token, chosen], dim=-1)
            torch.testing.assert_close(probs[token, chosen], expected)
    assert not torch.equal(routing_map, own_map)  # the replay changed the routing

    # Afterwards the routers route by their own scores again, and nothing is left behind.
    assert all(r.router_replay_action is None and r.target_topk_idx is None for r in replays)
    again_probs, again_map = router.routing(logits)
    assert torch.equal(again_map, own_map) and torch.equal(again_probs, own_probs)


def test_replay_is_cleared_when_the_forward_raises(megatron_group):
    from relax_core.train.megatron.replay import replaying, router_replays

    model = build(three_layer_moe())
    replays = router_replays(model)
    indices = [torch.zeros(1, K, dtype=torch.long)] * 2
    with pytest.raises(RuntimeError, match="boom"), replaying(replays, indices):
        raise RuntimeError("boom")
    assert all(r.router_replay_action is None and r.target_topk_idx is None for r in replays)
    assert all(r.replay_backward_list == [] for r in replays)
    with pytest.raises(ValueError, match="1 MoE layers of experts for 2 MoE routers"):
        replaying(replays, indices[:1]).__enter__()


def test_backend_rejects_micro_batches_that_do_not_match_its_routing_replay(megatron_group):
    # MegatronBackend.__init__ needs CUDA; its routing step does not, so it is set up by hand
    # here (tests/gpu/test_megatron_replay_gpu.py runs the whole backend).
    from relax_core.train.batch import make_micro_batch
    from relax_core.train.megatron.backend import MegatronBackend
    from relax_core.train.megatron.replay import router_replays

    config = three_layer_moe()
    backend = MegatronBackend.__new__(MegatronBackend)
    backend.hf_config, backend.parallel = config, MegatronParallel()
    backend.device = torch.device("cpu")
    backend.routing_replay, backend._replays = True, router_replays(build(config))
    plain = make_micro_batch([[1, 2]], [[3]], [[1]], pad_token_id=0)
    routed = torch.zeros(1, 3, 3 * K, dtype=torch.long)
    routed[0, 0, K:] = torch.tensor([1, 3, 2, 0])  # position 0: layer 1 -> (1, 3), 2 -> (2, 0)
    with_experts = make_micro_batch(
        [[1, 2]], [[3]], [[1]], pad_token_id=0, routed_experts=[routed[0, :2].tolist()]
    )
    with pytest.raises(ValueError, match="no routed_experts"):
        backend._routing(plain)
    with backend._routing(with_experts):
        targets = [r.target_topk_idx.tolist() for r in backend._replays]
    # Three tokens (B=1): position 0 recorded, position 1 all zeros, position 2 the last token.
    assert targets == [[[1, 3], [0, 1], [0, 1]], [[2, 0], [0, 1], [0, 1]]]
    assert all(r.target_topk_idx is None for r in backend._replays)
    backend.routing_replay, backend._replays = False, []
    with pytest.raises(ValueError, match="without routing_replay"):
        backend._routing(with_experts)
