"""actor_fwd role: log-probs of each response under the newest policy weights this service has
received, as `old_logprobs` (the proximal policy of the PPO ratio).

Its weights follow the trainer through the same weight sync as the rollout engines; the
version they had is recorded per entry (meta `fwd_version`). Without this role the trainer
interpolates the proximal policy instead (algorithms/decoupled.py).
"""

from __future__ import annotations

import pyarrow as pa

from relax_core.roles.reference import add_ref_logprobs


def serve(ctx) -> None:
    from relax_core.models.lora import synced_weights
    from relax_core.models.policy import load_policy, on_accelerator
    from relax_core.models.precision import computing_as_trainer
    from relax_core.pool.weights import make_receiver
    from relax_core.roles.media import resolver_for
    from relax_core.roles.service import serve_stage, set_threads
    from relax_core.sync import apply_update
    from relax_core.sync.buckets import specs_of
    from relax_core.train.checkpoint import read_state

    cfg = ctx.cfg
    set_threads(cfg.services.rollout_threads)
    model, tokenizer = load_policy(ctx.checkpoint, cfg.model.dtype)
    specs = specs_of(synced_weights(model))  # what the trainer publishes (float32 weights)
    model = computing_as_trainer(model, cfg.model.matmul_dtype)
    model = on_accelerator(model.eval().requires_grad_(False))
    if cfg.train.routing_replay:  # the proximal policy routes as the trainer will
        from relax_core.models.routing_replay import attach_routing_replay

        attach_routing_replay(model)
    resolver = resolver_for(cfg, model)
    holder = _WeightHolder(model, int(read_state(ctx.checkpoint)["policy_version"]))
    receiver = make_receiver(cfg, ctx.queue, specs, "actor_fwd", 0)
    ctx.status["state"] = "joining weight sync"
    receiver.init()
    receiver.start()

    def refresh() -> None:
        update = receiver.take()
        if update is not None:
            apply_update(holder, update, receiver.release)
            ctx.status["policy_version"] = holder.version

    def transform(table: pa.Table) -> pa.Table:
        return add_ref_logprobs(
            model,
            table,
            tokenizer.pad_token_id,
            cfg.train.micro_batch_tokens,
            cfg.rollout.temperature,
            "old_logprobs",
            resolver,
            cfg.train.routing_replay,
        )

    try:
        serve_stage(ctx, transform, refresh, busy_threads=cfg.services.rollout_threads)
    finally:
        receiver.destroy()


class _WeightHolder:
    """The update target for a model that only scores (the engine verbs without generation)."""

    def __init__(self, model, version: int) -> None:
        self.model = model
        self.version = version

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def update_weights(self, named_tensors, version: int) -> None:
        import torch

        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
        self.version = version
