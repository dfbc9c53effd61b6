"""Trainer role: one optimizer step on a step batch of `ready` rows with the configured loss.

old_logprobs come from the `fwd` stage when the actor_fwd role ran; in colocate mode with one
optimizer step per batch the proximal policy IS the current policy, so they are taken from the
same forward pass (detached) and the extra forward is skipped.
"""

from __future__ import annotations

import pyarrow as pa
import torch

from relax_core.algorithms import POLICY_LOSSES, LossInputs
from relax_core.config import AlgorithmConfig
from relax_core.services.batching import table_micro_batches
from relax_core.train.backend import MicroBatchLoss, TrainBackend
from relax_core.train.batch import MicroBatch


def _loss_fn(algo: AlgorithmConfig, num_tokens: float, num_seqs: float) -> MicroBatchLoss:
    loss_impl = POLICY_LOSSES[algo.loss]

    def fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        old = mb.extras.get("old_logprobs", logprobs.detach())
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


def train_on_table(
    backend: TrainBackend,
    table: pa.Table,
    algo: AlgorithmConfig,
    pad_token_id: int,
    token_budget: int,
) -> dict[str, float]:
    extras = ["advantages", "rollout_logprobs"]
    if algo.kl_coef > 0:
        extras.append("ref_logprobs")
    if table.column("old_logprobs").null_count == 0:
        extras.append("old_logprobs")
    batches = [
        mb for _, mb in table_micro_batches(table, pad_token_id, token_budget, tuple(extras))
    ]
    num_tokens = float(sum(mb.loss_mask.sum() for mb in batches))
    num_seqs = float(sum((mb.loss_mask.sum(-1) > 0).sum() for mb in batches))
    metrics = backend.train_step(batches, _loss_fn(algo, num_tokens, num_seqs))
    versions = table.column("behaviour_version_min").to_pylist()
    out = {f"train/{k}": v for k, v in metrics.items()}
    out["train/micro_batches"] = float(len(batches))
    out["train/trained_tokens"] = num_tokens
    out["train/behaviour_version_min"] = float(min(versions))
    return out
