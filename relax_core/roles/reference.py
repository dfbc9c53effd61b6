"""Reference and teacher roles: log-probs of the responses under a frozen model (the reference
for the KL term, the teacher for on-policy distillation), into their own column."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow as pa
import torch
from transformers import PreTrainedModel

from relax_core.queue import with_columns
from relax_core.train.batch import MicroBatch
from relax_core.train.batching import table_micro_batches
from relax_core.train.torch_backend import response_logprobs


@torch.no_grad()
def add_ref_logprobs(
    model: PreTrainedModel,
    table: pa.Table,
    pad_token_id: int,
    token_budget: int,
    temperature: float,
    column: str = "ref_logprobs",
    resolver: Any = None,
    routed_experts: bool = False,
    scorer: Callable[[MicroBatch], torch.Tensor] | None = None,
) -> pa.Table:
    """`column` = log-probs of each row's response under `model`; with `routed_experts` its
    routers replay the rows' experts (the actor_fwd role of a routing-replay run). `scorer`
    scores a micro-batch instead of `model` directly (a train backend's `logprobs`, which
    gathers a sharded policy's weights)."""
    out: list[list[float]] = [[] for _ in range(table.num_rows)]
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    batches = table_micro_batches(
        table, pad_token_id, token_budget, resolver=resolver, routed_experts=routed_experts
    )
    device = next(model.parameters()).device
    for rows, mb in batches:
        if scorer is not None:
            logprobs = scorer(mb)
        else:
            logprobs, _ = response_logprobs(model, mb.to(device), temperature)
        for j, i in enumerate(rows):
            out[i] = logprobs[j, : lengths[i]].tolist()
    return with_columns(table, **{column: out})


def serve(ctx) -> None:
    """The reference service: `rollout` entries -> `ref` with ref_logprobs (KL anchor: the
    run's starting policy) and/or teacher_logprobs (distillation)."""
    from relax_core.models.policy import (
        PREPARED_MARKER,
        load_policy,
        load_teacher,
        on_accelerator,
    )
    from relax_core.models.precision import computing_as_trainer
    from relax_core.roles.media import resolver_for
    from relax_core.roles.service import serve_stage, set_threads
    from relax_core.storage import local_copy
    from relax_core.train.checkpoint import read_state

    cfg = ctx.cfg
    set_threads(cfg.services.rollout_threads)
    start_policy = read_state(ctx.checkpoint).get("policy_dir")
    if start_policy:  # the KL anchor: the run's starting policy, wherever it is stored
        options, scratch = cfg.storage.options(), cfg.storage.scratch_dir
        start_policy = local_copy(start_policy, PREPARED_MARKER, options, scratch)
    else:
        start_policy = ctx.checkpoint
    model, tokenizer = load_policy(start_policy, cfg.model.dtype)
    frozen = []
    if cfg.algorithm.kl_coef > 0:  # scored as the policy is (model.matmul_dtype)
        model = computing_as_trainer(model, cfg.model.matmul_dtype)
        frozen.append((on_accelerator(model.eval().requires_grad_(False)), "ref_logprobs"))
    if cfg.algorithm.distill_coef > 0:
        teacher, _ = load_teacher(cfg.algorithm.teacher, tokenizer, cfg.model.dtype)
        frozen.append((on_accelerator(teacher), "teacher_logprobs"))
    # One resolver per model for the life of the role: its cache spans tables.
    frozen = [(m, column, resolver_for(cfg, m)) for m, column in frozen]

    def transform(table: pa.Table) -> pa.Table:
        for m, column, resolver in frozen:
            table = add_ref_logprobs(
                m,
                table,
                tokenizer.pad_token_id,
                cfg.train.micro_batch_tokens,
                cfg.rollout.temperature,
                column,
                resolver,
            )
        return table

    serve_stage(ctx, transform, busy_threads=cfg.services.rollout_threads)
