"""Rollout routing replay (R3) in the Megatron backend: the experts a micro-batch's rows recorded
during generation become the top-k of each MoE router (megatron-core's RouterReplay).

`router_topk_indices` is pure: it turns `MicroBatch.routed_experts` [B, S, num_layers * top_k]
(layer-major per token, as models/routing_replay.py documents) into one [tokens, top_k] tensor per
MoE layer, in the order that layer's router sees its tokens. GPTModel runs on [S, B, H] hidden
states and TopKRouter.routing flattens its logits with `view(-1, num_experts)`, so router token
`s * B + b` is sequence position s of row b. With sequence parallel, each TP rank's router sees
only its slice of the (right-padded) sequence. Expert ids are global: the router scores all
experts; the token dispatcher maps them to expert-parallel ranks afterwards.

`router_replays` finds a GPTModel's RouterReplay objects (one per MoE layer, in layer order) and
`replaying` routes one micro-batch through them with REPLAY_FORWARD: the router takes the given
experts and weights them with its own scores gathered there, so it still learns through the
weights. REPLAY_BACKWARD only matters when the MoE layer's forward reruns in backward (activation
recomputation), which the backend does not enable; `check_no_recompute` keeps it that way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from relax_core.train.megatron.config import MegatronParallel
from relax_core.train.megatron.names import Dims


def router_topk_indices(
    routed_experts: torch.Tensor,
    input_shape: tuple[int, int],
    dims: Dims,
    top_k: int,
    parallel: MegatronParallel,
    tp_rank: int = 0,
) -> list[torch.Tensor]:
    """One long tensor [S_local * B, top_k] per MoE layer (dense layers get none), row s * B + b
    holding the experts of sequence position s of row b.

    `routed_experts` [B, S, num_layers * top_k] is aligned with input_ids of `input_shape` [B, S].
    A token whose slots are all 0 has no recorded routing (a row's last token, padding) and so
    do the positions sequence parallel pads on: they go to experts 0..top_k-1, a well-formed
    top-k that no response log-prob depends on (they come after every real token, or predict
    nothing). With sequence parallel, S_local = padded S / tp and rank `tp_rank` gets positions
    [tp_rank * S_local, (tp_rank + 1) * S_local); otherwise every TP rank sees all S.
    ValueError when the shape, an expert id, or a token's top-k (ids not distinct) is wrong.
    """
    if parallel.pp != 1:
        raise NotImplementedError(f"routing replay needs pp=1 (got pp={parallel.pp})")
    if not dims.num_experts:
        raise ValueError(f"routing replay needs an MoE model; {dims.model_type} is dense")
    if not 0 <= tp_rank < parallel.tp:
        raise ValueError(f"tp_rank {tp_rank} outside 0..{parallel.tp - 1}")
    layers, width = dims.num_layers, dims.num_layers * top_k
    if routed_experts.dim() != 3 or routed_experts.shape[-1] != width:
        raise ValueError(
            f"routed_experts of shape {tuple(routed_experts.shape)}; expected "
            f"[B, S, num_layers * top_k] = [B, S, {layers} * {top_k}]"
        )
    if tuple(routed_experts.shape[:2]) != tuple(input_shape):
        raise ValueError(
            f"routed_experts covers [B, S] = {list(routed_experts.shape[:2])}, input_ids "
            f"{list(input_shape)}"
        )
    if routed_experts.dtype.is_floating_point or routed_experts.dtype.is_complex:
        raise ValueError(f"routed_experts must hold integer expert ids, got {routed_experts.dtype}")
    moe = [i for i in range(layers) if dims.moe_layers[i]]
    experts = routed_experts.long().reshape(*input_shape, layers, top_k)[:, :, moe]  # [B,S,M,K]
    unrouted = torch.arange(top_k, device=experts.device).expand_as(experts)
    no_data = (routed_experts == 0).all(dim=-1)[:, :, None, None]
    experts = torch.where(no_data, unrouted, experts)
    _check_experts(experts, moe, dims.num_experts)
    padded = parallel.padded_length(input_shape[1])
    if padded > input_shape[1]:
        pad = unrouted[:, :1].expand(-1, padded - input_shape[1], -1, -1)
        experts = torch.cat([experts, pad], dim=1)
    if parallel.sequence_parallel:
        local = padded // parallel.tp
        experts = experts[:, tp_rank * local : (tp_rank + 1) * local]
    by_position = experts.transpose(0, 1)  # [S_local, B, M, K]: the router's s-major order
    return [by_position[:, :, m].reshape(-1, top_k).contiguous() for m in range(len(moe))]


def _check_experts(experts: torch.Tensor, moe: list[int], num_experts: int) -> None:
    """experts [B, S, M, K] for the MoE layers `moe`: ids in range and distinct per token."""
    if not experts.numel():
        return
    bad = (experts < 0) | (experts >= num_experts)
    if bad.any():
        b, s, m, _ = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"routed_experts: row {b}, position {s}, layer {moe[m]} has expert ids "
            f"{experts[b, s, m].tolist()}, outside 0..{num_experts - 1}"
        )
    ordered = experts.sort(dim=-1).values
    repeated = (ordered[..., 1:] == ordered[..., :-1]).any(dim=-1)
    if repeated.any():
        b, s, m = (int(i) for i in repeated.nonzero()[0])
        raise ValueError(
            f"routed_experts: row {b}, position {s}, layer {moe[m]} repeats an expert "
            f"({experts[b, s, m].tolist()}); a top-k holds distinct experts"
        )


def router_replays(model: torch.nn.Module) -> list[Any]:
    """The RouterReplay of every MoE router of a GPTModel, in layer order (module order)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    return [
        replay
        for module in model.modules()
        if isinstance(replay := getattr(module, "router_replay", None), RouterReplay)
    ]


def check_no_recompute(config: Any) -> None:
    """REPLAY_FORWARD covers one forward per micro-batch; recomputation reruns the router in
    backward, which would need REPLAY_BACKWARD."""
    if getattr(config, "recompute_granularity", None) is not None:
        raise NotImplementedError(
            f"routing replay with recompute_granularity={config.recompute_granularity!r}: the "
            "Megatron backend replays the forward only (no activation recomputation)"
        )


@contextmanager
def replaying(replays: list[Any], indices: list[torch.Tensor]) -> Iterator[None]:
    """Inside: each router takes `indices[i]` as its top-k (REPLAY_FORWARD). After, even on
    error: indices and actions cleared, so the next forward routes by its own scores."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    if len(replays) != len(indices):
        raise ValueError(f"{len(indices)} MoE layers of experts for {len(replays)} MoE routers")
    try:
        for replay, topk in zip(replays, indices, strict=True):
            replay.set_target_indices(topk)
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        yield
    finally:
        for replay in replays:
            replay.clear_indices()
            replay.clear_router_replay_action()
