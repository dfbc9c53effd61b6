"""Rollout routing replay (R3) for MoE policies: the trainer's routers use the rollout's experts.

In MoE RL the experts the inference engine's router picks and the ones the trainer's forward
picks differ (numerics: kernels, batch shape, KV cache), and a token whose experts changed has a
different probability, which blows up the importance ratio. R3 records the experts each token
was routed to during generation and replays them in the training forward: the router returns
the recorded experts, weighted by its own softmax over its own logits gathered at those experts
(renormalised as the model's router does), so the router still learns through those weights.

`attach_routing_replay(model)` finds every sparse-MoE block of an HF model (a `gate` router with
`top_k`/`num_experts`/`norm_topk_prob` next to `experts`, as Qwen3-MoE has) and puts a
`ReplayRouter` in place of each block's router on that instance. The wrapper registers the
router's own parameters under their own names, so parameter names, state dicts, checkpoints and
weight sync are unchanged. Modes, set through the returned `RoutingReplay`:
- off (default): the router's own output, bit-exact;
- `capture()`: record the experts of every token of each forward (prefill: all tokens; a
  decode step with KV cache: its one token);
- `replay(indices)`: route by `indices` [B, S, L, K] (or [B, S, L*K]) for a forward over
  input_ids [B, S].

Layout of the experts of one token: [num_layers, top_k] over the decoder layers (a dense layer's
slots hold 0), flattened to num_layers * top_k ints, as SGLang's `routed_experts` reports them.
Router outputs recorded by transformers' `output_router_logits` are not routed through the
wrapper; R3 runs do not use the load-balancing loss.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

_HANDLE = "_relax_routing_replay"
_ROUTER_ATTRS = ("top_k", "num_experts", "norm_topk_prob")


class ReplayRouter(nn.Module):
    """One MoE block's router with capture and replay; off, it returns the router's output."""

    def __init__(self, router: nn.Module, layer: int) -> None:
        super().__init__()
        # Held outside the module tree: its parameters are registered here under their own
        # names, so `...mlp.gate.weight` stays `...mlp.gate.weight`.
        self.__dict__["router"] = router
        for name, param in router.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in router.named_buffers(recurse=False):
            self.register_buffer(name, buf)
        self.layer = layer
        self.top_k = int(router.top_k)
        self.num_experts = int(router.num_experts)
        self.norm_topk_prob = bool(router.norm_topk_prob)
        self.recorded: list[torch.Tensor] | None = None
        """Capture: each forward's experts [tokens, top_k] are appended here."""
        self.replayed: torch.Tensor | None = None
        """Replay: the experts [tokens, top_k] the next forwards route to."""

    def forward(self, hidden_states: torch.Tensor):
        router = self.router
        for name, param in self._parameters.items():
            # Whoever replaced a parameter on this module (e.g. a load, a sharding wrapper)
            # replaced it for the router too.
            if router._parameters[name] is not param:
                router._parameters[name] = param
        logits, weights, experts = router(hidden_states)
        if self.replayed is not None:
            if self.replayed.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"routing replay, layer {self.layer}: {self.replayed.shape[0]} tokens of "
                    f"recorded experts for a forward over {logits.shape[0]} tokens"
                )
            experts = self.replayed
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            weights = probs.gather(-1, experts)
            if self.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights.to(logits.dtype)
        if self.recorded is not None:
            self.recorded.append(experts.detach())
        return logits, weights, experts


class Capture:
    """The experts recorded by the routers of one `RoutingReplay.capture()`."""

    def __init__(self, replay: RoutingReplay) -> None:
        self._replay = replay
        self.per_layer: dict[int, list[torch.Tensor]] = {r.layer: [] for r in replay.routers}

    def forwards(self) -> list[torch.Tensor]:
        """One [tokens, L, K] long tensor per forward, in call order."""
        counts = {len(calls) for calls in self.per_layer.values()}
        if len(counts) != 1:
            raise RuntimeError(f"routers were called unevenly during capture: {sorted(counts)}")
        r = self._replay
        out = []
        for step in range(counts.pop()):
            first = next(iter(self.per_layer.values()))[step]
            experts = torch.zeros(
                (first.shape[0], r.num_layers, r.top_k), dtype=torch.long, device=first.device
            )
            for layer, calls in self.per_layer.items():
                experts[:, layer] = calls[step]
            out.append(experts)
        return out

    def tokens(self, batch_size: int) -> torch.Tensor:
        """[B, T, L, K]: every forward's tokens, in order (for generation with a KV cache: the
        prefill's T0 tokens, then one per decode step)."""
        steps = [f.reshape(batch_size, -1, *f.shape[1:]) for f in self.forwards()]
        return torch.cat(steps, dim=1)


class RoutingReplay:
    """The replay routers of one model and the modes they run in."""

    def __init__(self, routers: list[ReplayRouter], num_layers: int) -> None:
        self.routers = routers
        self.num_layers = num_layers
        self.top_k = routers[0].top_k
        self.num_experts = routers[0].num_experts

    @property
    def width(self) -> int:
        """Ints per token in the flattened layout: num_layers * top_k."""
        return self.num_layers * self.top_k

    @contextmanager
    def capture(self) -> Iterator[Capture]:
        cap = Capture(self)
        for router in self.routers:
            router.recorded = cap.per_layer[router.layer]
        try:
            yield cap
        finally:
            for router in self.routers:
                router.recorded = None

    @contextmanager
    def replay(self, experts: torch.Tensor) -> Iterator[None]:
        """Route forwards over [B, S] tokens to `experts` [B, S, L, K] or [B, S, L*K]."""
        if experts.dim() == 3 and experts.shape[-1] == self.width:
            experts = experts.reshape(*experts.shape[:2], self.num_layers, self.top_k)
        if experts.dim() != 4 or tuple(experts.shape[2:]) != (self.num_layers, self.top_k):
            raise ValueError(
                f"routing replay: experts of shape {tuple(experts.shape)}; expected "
                f"[B, S, {self.num_layers}, {self.top_k}] or [B, S, {self.width}]"
            )
        if experts.numel() and not 0 <= int(experts.min()) <= int(experts.max()) < (
            self.num_experts
        ):
            raise ValueError(
                f"routing replay: expert ids span {int(experts.min())}..{int(experts.max())}, "
                f"outside 0..{self.num_experts - 1}"
            )
        device = self.routers[0].router.weight.device
        experts = experts.to(device=device, dtype=torch.long)
        for router in self.routers:
            router.replayed = experts[:, :, router.layer].reshape(-1, self.top_k)
        try:
            yield
        finally:
            for router in self.routers:
                router.replayed = None


def routing_of(model: nn.Module) -> RoutingReplay | None:
    """The routing replay attached to `model`, or None (a dense policy, or none attached)."""
    return getattr(model, _HANDLE, None)


def attach_routing_replay(model: nn.Module) -> RoutingReplay:
    """Wrap every sparse-MoE router of `model` (idempotent); ValueError naming the model class
    when it has none."""
    found = routing_of(model)
    if found is not None:
        return found
    blocks = [(name, module) for name, module in model.named_modules() if _is_moe_block(module)]
    if not blocks:
        raise ValueError(
            f"routing replay: {type(model).__name__} has no sparse-MoE block (a `gate` router "
            f"with {', '.join(_ROUTER_ATTRS)} next to `experts`, as Qwen3-MoE has); "
            "train.routing_replay needs an MoE policy"
        )
    layers = [_layer_index(name, i) for i, (name, _) in enumerate(blocks)]
    if len(set(layers)) != len(layers):
        raise ValueError(f"routing replay: {type(model).__name__} has two MoE blocks per layer")
    config = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    num_layers = max(getattr(text, "num_hidden_layers", 0) or 0, max(layers) + 1)
    routers = []
    for (_, block), layer in zip(blocks, layers, strict=True):
        router = ReplayRouter(block.gate, layer)
        block.gate = router
        routers.append(router)
    replay = RoutingReplay(routers, num_layers)
    object.__setattr__(model, _HANDLE, replay)
    return replay


def _is_moe_block(module: nn.Module) -> bool:
    gate = module._modules.get("gate")
    return (
        gate is not None
        and "experts" in module._modules
        and all(hasattr(gate, attr) for attr in _ROUTER_ATTRS)
        and isinstance(getattr(gate, "weight", None), torch.Tensor)
    )


def _layer_index(name: str, fallback: int) -> int:
    """The decoder layer of a block named like `model.layers.3.mlp`."""
    numbers = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(numbers[-1]) if numbers else fallback
