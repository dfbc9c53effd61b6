"""Trainer role: one optimizer step on a step batch of `ready` rows with the configured loss.

old_logprobs come from the `fwd` stage when the actor_fwd role ran. Without it, in colocate mode
the proximal policy is the one that generated the batch: for a single update it is the current
policy (taken from the same forward pass, detached, so no extra forward), and for several
mini-batch updates it is the rollout engine's log-probs, computed with the very weights the
trainer held when the batch was generated.
"""

from __future__ import annotations

import pyarrow as pa
import torch

from relax_core.algorithms import POLICY_LOSSES, LossInputs
from relax_core.config import AlgorithmConfig
from relax_core.services.batching import table_micro_batches
from relax_core.train.backend import MicroBatchLoss, TrainBackend
from relax_core.train.batch import MicroBatch


def _loss_fn(
    algo: AlgorithmConfig, num_tokens: float, num_seqs: float, proximal: str
) -> MicroBatchLoss:
    loss_impl = POLICY_LOSSES[algo.loss]

    def fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        old = mb.extras[proximal] if proximal else logprobs.detach()
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=mb.extras["advantages"],
            loss_mask=mb.loss_mask,
            ref_logprobs=mb.extras.get("ref_logprobs"),
            rollout_logprobs=mb.extras["rollout_logprobs"],
            entropy=entropy if algo.entropy_coef > 0 else entropy.detach(),
        )
        loss, metrics = loss_impl(
            inputs,
            eps_clip=algo.eps_clip,
            eps_clip_high=algo.eps_clip_high,
            kl_coef=algo.kl_coef,
            kl_kind=algo.kl_kind,
            entropy_coef=algo.entropy_coef,
            agg=algo.loss_agg,
            num_tokens=num_tokens,
            num_seqs=num_seqs,
        )
        mask = mb.loss_mask
        gap = (mb.extras["rollout_logprobs"] - logprobs.detach()) * mask
        metrics["rollout_train_kl"] = gap.sum() / mask.sum().clamp(min=1)
        return loss, metrics

    return fn


def _split_groups(table: pa.Table, parts: int) -> list[pa.Table]:
    """`parts` tables of whole groups, in order of first appearance."""
    if parts == 1:
        return [table]
    group_ids = table.column("group_id").to_pylist()
    order = list(dict.fromkeys(group_ids))
    part_of = {g: i * parts // len(order) for i, g in enumerate(order)}
    rows: list[list[int]] = [[] for _ in range(parts)]
    for i, g in enumerate(group_ids):
        rows[part_of[g]].append(i)
    return [table.take(r) for r in rows if r]


def train_on_table(
    backend: TrainBackend,
    table: pa.Table,
    algo: AlgorithmConfig,
    pad_token_id: int,
    token_budget: int,
    minibatches: int = 1,
) -> dict[str, float]:
    """Train on one step batch: `minibatches` optimizer updates; returns averaged metrics."""
    extras = ["advantages", "rollout_logprobs"]
    if algo.kl_coef > 0:
        extras.append("ref_logprobs")
    proximal = ""
    if table.column("old_logprobs").null_count == 0:
        extras.append("old_logprobs")
        proximal = "old_logprobs"
    elif minibatches > 1:
        proximal = "rollout_logprobs"
    sums: dict[str, float] = {}
    n_micro, trained = 0, 0.0
    for part in _split_groups(table, minibatches):
        mbs = [mb for _, mb in table_micro_batches(part, pad_token_id, token_budget, tuple(extras))]
        num_tokens = float(sum(mb.loss_mask.sum() for mb in mbs))
        num_seqs = float(sum((mb.loss_mask.sum(-1) > 0).sum() for mb in mbs))
        metrics = backend.train_step(mbs, _loss_fn(algo, num_tokens, num_seqs, proximal))
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value / minibatches
        n_micro, trained = n_micro + len(mbs), trained + num_tokens
    out = {f"train/{k}": v for k, v in sums.items()}
    out["train/micro_batches"] = float(n_micro)
    out["train/trained_tokens"] = trained
    out["train/behaviour_version_min"] = float(
        min(table.column("behaviour_version_min").to_pylist())
    )
    return out
