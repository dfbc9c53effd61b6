"""Trainer role: one optimizer step on a step batch of `ready` rows with the configured loss.

The proximal ("old") log-probs the PPO-style ratio is taken against come from the `fwd` stage
when the actor_fwd role ran. Otherwise they are interpolated by policy version between the
rollout engine's log-probs and the current ones (algorithms/decoupled.py): exact for on-policy
rows, where the first update's proximal policy is the current one (taken from the same forward
pass, detached, so no extra forward) and later mini-batch updates' is the one that generated the
batch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pyarrow as pa
import torch

from relax_core.algorithms import (
    POLICY_LOSSES,
    LossInputs,
    LossSettings,
    interpolate_proximal,
    proximal_alpha,
)
from relax_core.config import AlgorithmConfig
from relax_core.train.backend import MicroBatchLoss, TrainBackend
from relax_core.train.batch import MicroBatch
from relax_core.train.batching import table_micro_batches
from relax_core.train.inert import can_skip_inert, live_groups, loss_counts


def loss_settings(algo: AlgorithmConfig, max_new_tokens: int) -> LossSettings:
    """The loss knobs of `algo` (same names, `loss_agg` -> `agg`); Dr. GRPO's fixed length is
    the generation budget."""
    shared = {
        f.name: getattr(algo, f.name)
        for f in dataclasses.fields(LossSettings)
        if hasattr(algo, f.name)
    }
    return LossSettings(**shared, agg=algo.loss_agg, norm_len=float(max_new_tokens))


def _loss_fn(
    algo: AlgorithmConfig,
    settings: LossSettings,
    num_tokens: float,
    num_seqs: float,
    mismatch: dict[int, list[float]],
) -> MicroBatchLoss:
    """The backend's loss over one micro-batch; also adds, per staleness k, [rollout-vs-train
    log-ratio sum, tokens, masked tokens, clipped tokens] to `mismatch[k]`."""
    loss_impl = POLICY_LOSSES[algo.loss]

    def fn(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
        rollout = mb.extras["rollout_logprobs"]
        if "old_logprobs" in mb.extras:
            old = mb.extras["old_logprobs"]
        elif algo.proximal == "behaviour":
            old = rollout
        else:
            old = interpolate_proximal(rollout, logprobs, mb.extras["proximal_alpha"])
        inputs = LossInputs(
            logprobs=logprobs,
            old_logprobs=old,
            advantages=mb.extras["advantages"],
            loss_mask=mb.loss_mask,
            ref_logprobs=mb.extras.get("ref_logprobs"),
            rollout_logprobs=rollout,
            entropy=entropy if algo.entropy_coef > 0 else entropy.detach(),
        )
        loss, metrics = loss_impl(inputs, settings, num_tokens, num_seqs)
        mask = mb.loss_mask
        gap = (rollout - logprobs.detach()) * mask
        metrics["rollout_train_kl"] = gap.sum() / mask.sum().clamp(min=1)
        masked = metrics.pop("_token/masked")
        clipped = metrics.pop("_token/clipped", torch.zeros_like(masked))
        _count_by_staleness(mismatch, mb.extras["staleness"], mask, gap, masked, clipped)
        return loss, metrics

    return fn


def _count_by_staleness(
    mismatch: dict[int, list[float]],
    staleness: torch.Tensor,
    mask: torch.Tensor,
    gap: torch.Tensor,
    masked: torch.Tensor,
    clipped: torch.Tensor,
) -> None:
    """Add, per staleness k of the live tokens, [log-ratio sum, tokens, masked, clipped] to
    `mismatch[k]`; one transfer to the host per micro-batch."""
    live = mask > 0
    k = staleness[live].long().clamp(min=0)
    values = torch.stack(
        [
            gap[live],
            torch.ones_like(gap[live]),
            masked[live].to(gap.dtype),
            clipped[live].to(gap.dtype),
        ],
        dim=1,
    )
    sums = torch.zeros(int(k.max()) + 1 if k.numel() else 0, 4, dtype=gap.dtype, device=gap.device)
    for stale, row in enumerate(sums.index_add(0, k, values.detach()).tolist()):
        if row[1]:
            acc = mismatch.setdefault(stale, [0.0, 0.0, 0.0, 0.0])
            acc[:] = [a + b for a, b in zip(acc, row, strict=True)]


def mismatch_metrics(mismatch: dict[int, list[float]]) -> dict[str, float]:
    """Per staleness k (train version - behaviour version) and overall: the rollout-vs-train KL
    estimate (mean of rollout - train log-probs over the sampled tokens) and the share of
    tokens a correction masked or a clip held."""
    out: dict[str, float] = {}
    totals = [0.0, 0.0, 0.0, 0.0]
    for k, (gap, tokens, masked, clipped) in sorted(mismatch.items()):
        n = max(tokens, 1.0)
        out[f"mismatch/kl_s{k}"] = gap / n
        out[f"mismatch/masked_frac_s{k}"] = masked / n
        out[f"mismatch/clipped_frac_s{k}"] = clipped / n
        totals = [t + v for t, v in zip(totals, (gap, tokens, masked, clipped), strict=True)]
    n = max(totals[1], 1.0)
    out.update(
        {
            "mismatch/kl": totals[0] / n,
            "mismatch/masked_frac": totals[2] / n,
            "mismatch/clipped_frac": totals[3] / n,
        }
    )
    return out


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


def _per_token(table: pa.Table, values: list[float]) -> list[list[float]]:
    """One value per row, repeated over its response tokens."""
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    return [[v] * n for v, n in zip(values, lengths, strict=True)]


def _alpha_per_token(table: pa.Table, train_version: int, progress: float) -> list[list[float]]:
    versions = torch.tensor(table.column("behaviour_version_min").to_pylist())
    alpha = proximal_alpha(versions, float(train_version), progress).flatten().tolist()
    return _per_token(table, alpha)


def train_on_table(
    backend: TrainBackend,
    table: pa.Table,
    algo: AlgorithmConfig,
    pad_token_id: int,
    token_budget: int,
    minibatches: int = 1,
    *,
    train_version: int = 0,
    max_new_tokens: int = 1,
    resolver: Any = None,
    routing_replay: bool = False,
    skip_inert: bool = False,
) -> dict[str, float]:
    """Train on one step batch: `minibatches` optimizer updates; returns averaged metrics.

    `train_version`: the policy version being trained (rows' staleness is measured from it).
    `routing_replay`: the forwards route each token to the experts its row recorded.
    `skip_inert` (train.skip_inert_groups): groups whose every advantage is 0 stay out of the
    forward and backward when they add nothing to the gradient (train/inert.py); the loss still
    divides by the whole batch's tokens and sequences, and `train/inert_groups` counts them.
    """
    share = getattr(backend, "share_step", None)
    if share is not None:  # a trainer over several GPUs: every rank trains on this batch
        share(
            table,
            {
                "pad_token_id": pad_token_id,
                "token_budget": token_budget,
                "minibatches": minibatches,
                "train_version": train_version,
                "max_new_tokens": max_new_tokens,
                "routing_replay": routing_replay,
            },
        )
    settings = dataclasses.replace(loss_settings(algo, max_new_tokens), token_masks=True)
    extras = ["advantages", "rollout_logprobs"]
    if algo.kl_coef > 0:
        extras.append("ref_logprobs")
    recomputed = table.column("old_logprobs").null_count == 0
    if recomputed:
        extras.append("old_logprobs")
    skip_inert = skip_inert and can_skip_inert(algo)
    sums: dict[str, float] = {}
    mismatch: dict[int, list[float]] = {}
    n_micro, trained, inert = 0, 0.0, 0
    parts = _split_groups(table, minibatches)
    for k, whole in enumerate(parts):
        num_tokens, num_seqs = loss_counts(whole)
        part, left_out = live_groups(whole) if skip_inert else (whole, 0)
        inert += left_out
        versions = part.column("behaviour_version_min").to_pylist()
        computed = {"staleness": _per_token(part, [float(train_version - b) for b in versions])}
        if not recomputed and algo.proximal == "interpolate":
            computed["proximal_alpha"] = _alpha_per_token(part, train_version, k / len(parts))
        mbs = [
            mb
            for _, mb in table_micro_batches(
                part, pad_token_id, token_budget, tuple(extras), computed, resolver, routing_replay
            )
        ]
        loss_fn = _loss_fn(algo, settings, num_tokens, num_seqs, mismatch)
        metrics = backend.train_step(mbs, loss_fn)
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value / len(parts)
        n_micro, trained = n_micro + len(mbs), trained + num_tokens
    out = {f"train/{k}": v for k, v in sums.items()}
    out.update(mismatch_metrics(mismatch))
    out["train/micro_batches"] = float(n_micro)
    out["train/trained_tokens"] = trained
    out["train/inert_groups"] = float(inert)
    out["train/behaviour_version_min"] = float(
        min(table.column("behaviour_version_min").to_pylist())
    )
    return out
