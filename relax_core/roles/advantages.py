"""Advantages role: one advantage per response (algorithm.advantage: GRPO, RLOO, REINFORCE++),
broadcast over its tokens, plus the on-policy distillation term per token when a teacher scored
the rows."""

from __future__ import annotations

import pyarrow as pa
import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS, distillation_advantages
from relax_core.config import AlgorithmConfig
from relax_core.queue import with_columns
from relax_core.roles.rollout import episode_uid


def add_advantages(
    table: pa.Table,
    estimator: str,
    normalize_std: bool,
    distill_coef: float = 0.0,
    token_level: bool = False,
) -> pa.Table:
    """Fill the `advantages` column ([len(response)] per row) from the rows' rewards (within each
    group, or over the whole table for REINFORCE++; `token_level`: its statistics weigh each row
    by its trained tokens); with `distill_coef` > 0 each token also gets
    -coef * (rollout_logprobs - teacher_logprobs)."""
    # One vote per episode: an agent episode's segments (several rows, one reward) count once.
    episodes: dict[str, int] = {}
    row_episode = [
        episodes.setdefault(episode_uid(u), len(episodes)) for u in table.column("uid").to_pylist()
    ]
    first = {e: i for i, e in reversed(list(enumerate(row_episode)))}
    picks = [first[e] for e in range(len(episodes))]
    group_ids = table.column("group_id").to_pylist()
    index: dict[str, int] = {}
    group_index = torch.tensor([index.setdefault(group_ids[i], len(index)) for i in picks])
    all_rewards = table.column("reward").to_pylist()
    rewards = torch.tensor([all_rewards[i] for i in picks], dtype=torch.float32)
    weights = None
    if token_level:
        trained = [0] * len(episodes)
        for e, m in zip(row_episode, table.column("loss_mask").to_pylist(), strict=True):
            trained[e] += sum(m)
        weights = torch.tensor(trained)
    per_episode = ADVANTAGE_ESTIMATORS[estimator](
        rewards, group_index, normalize_std=normalize_std, lengths=weights
    ).tolist()
    adv = [per_episode[e] for e in row_episode]
    lengths = [len(r) for r in table.column("response_ids").to_pylist()]
    per_token = [[a] * n for a, n in zip(adv, lengths, strict=True)]
    if distill_coef > 0:
        teacher = table.column("teacher_logprobs").to_pylist()
        if any(t is None for t in teacher):
            raise ValueError("distillation needs teacher_logprobs; the teacher role did not run")
        student = table.column("rollout_logprobs").to_pylist()
        masks = table.column("loss_mask").to_pylist()
        per_token = [
            distillation_advantages(
                torch.tensor(a), torch.tensor(st), torch.tensor(te), torch.tensor(m), distill_coef
            ).tolist()
            for a, st, te, m in zip(per_token, student, teacher, masks, strict=True)
        ]
    return with_columns(table, advantages=per_token)


def advantages_of(table: pa.Table, algo: AlgorithmConfig) -> pa.Table:
    """`add_advantages` with the run's algorithm settings (the colocate step and the service)."""
    token_level = algo.advantage_level == "token"
    return add_advantages(
        table, algo.advantage, algo.normalize_adv_std, algo.distill_coef, token_level
    )


def serve(ctx) -> None:
    """The advantages service: `ref`/`fwd`/`rollout` entries -> `ready` (same seq)."""
    from relax_core.roles.service import serve_stage

    serve_stage(ctx, lambda table: advantages_of(table, ctx.cfg.algorithm))
