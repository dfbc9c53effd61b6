"""Rollout role: prompts -> engine samples -> rewards -> rows of whole groups for the `rollout` stage.

Parts: a PromptSource (dataset order), a RolloutEngine (tokens and log-probs), a reward function
(scored per sample; a raising reward costs that sample, not the run). The same functions serve the
colocate controller and the rollout service (rollout_service.py). An agentic run (env.name set)
plays multi-turn episodes instead (episodes.py), rows of the same schema.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from relax_core.algorithms.dapo import has_signal, overlong_penalty
from relax_core.data.prompts import PromptItem
from relax_core.rewards import RewardFn, score_batch
from relax_core.rollout.engine import RolloutEngine, SamplingParams

log = logging.getLogger(__name__)


SEGMENT_SEP = "/seg"
"""An agent episode's k-th segment (k >= 1) is the row `{uid}/seg{k}` (roles/agents.py)."""


def episode_uid(uid: str) -> str:
    """The uid of the episode a row belongs to: its own, or its first segment's."""
    return uid.split(SEGMENT_SEP, 1)[0]


def group_columns(item: PromptItem, sample: int) -> dict[str, Any]:
    """The columns that place sample `sample` of prompt `item` in its group (one group per
    prompt of an epoch): uid, group_id, prompt_index, epoch, prompt_ids."""
    group_id = f"e{item.epoch}-p{item.prompt_index}"
    return {
        "uid": f"{group_id}-s{sample}",
        "group_id": group_id,
        "prompt_index": item.prompt_index,
        "epoch": item.epoch,
        "prompt_ids": item.prompt_ids,
    }


def rollout_groups(
    engine: RolloutEngine,
    tokenizer: Any,
    items: list[PromptItem],
    params: SamplingParams,
    n_samples: int,
    reward_fn: RewardFn,
    overlong_buffer: int = 0,
    overlong_penalty_max: float = 0.0,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Generate `n_samples` responses per prompt item; returns queue rows and rollout metrics.

    With `overlong_buffer` > 0 a response's reward loses up to `overlong_penalty_max` as its
    length enters the last `overlong_buffer` tokens of the budget (DAPO; `algorithms/dapo.py`).
    """
    t0 = time.perf_counter()
    prompts = [item.prompt_ids for item in items for _ in range(n_samples)]
    if any(item.media is not None for item in items):
        # A group's samples share their prompt's inputs: the policy encodes each medium once.
        media = [item.media or [] for item in items for _ in range(n_samples)]
        completions = engine.generate(prompts, params, media=media)
    else:
        completions = engine.generate(prompts, params)
    t1 = time.perf_counter()
    texts = tokenizer.batch_decode([c.response_ids for c in completions], skip_special_tokens=True)
    samples = [item.row for item in items for _ in range(n_samples)]
    results, errors = score_batch(reward_fn, texts, [s["answer"] for s in samples], samples)
    t2 = time.perf_counter()
    rows = []
    penalties = [
        overlong_penalty(
            len(c.response_ids), params.max_new_tokens, overlong_buffer, overlong_penalty_max
        )
        for c in completions
    ]
    for k, (comp, res) in enumerate(zip(completions, results, strict=True)):
        item = items[k // n_samples]
        info = {"correct": res.correct, **res.info}
        if penalties[k]:
            info["overlong_penalty"] = penalties[k]
        rows.append(
            {
                **group_columns(item, k % n_samples),
                "response_ids": comp.response_ids,
                "loss_mask": [1] * len(comp.response_ids),
                "rollout_logprobs": comp.logprobs,
                "reward": res.reward - penalties[k],
                "reward_info": info,
                "finish_reason": comp.finish_reason,
                "behaviour_version_min": comp.policy_version,
                "behaviour_version_max": (
                    comp.policy_version
                    if comp.policy_version_max is None
                    else comp.policy_version_max
                ),
                "turns": 1,
                "media": item.row.get("media"),
                "routed_experts": comp.routed_experts,
            }
        )
    metrics = rollout_metrics(rows)
    metrics.update(
        {
            "train/reward_errors": float(errors),
            "perf/generate_s": t1 - t0,
            "perf/reward_s": t2 - t1,
            "perf/generated_tokens": float(sum(len(c.response_ids) for c in completions)),
        }
    )
    return rows, metrics


def rollout_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Reward, accuracy (also per modality: `train/accuracy/<kind of the first medium>`),
    length and truncation means over rollout rows."""
    from relax_core.roles.evaluation import accuracy_by_modality

    n = max(1, len(rows))
    correct = [bool(r["reward_info"].get("correct")) for r in rows]
    return {
        "train/reward_mean": sum(r["reward"] for r in rows) / n,
        "train/accuracy": sum(correct) / n,
        "train/response_length": sum(len(r["response_ids"]) for r in rows) / n,
        "train/truncated_frac": sum(r["finish_reason"] == "length" for r in rows) / n,
        **accuracy_by_modality("train", [_modality(r) for r in rows], correct),
    }


def _modality(row: dict[str, Any]) -> dict[str, Any]:
    media = row.get("media") or []
    return {"meta": {"modality": media[0]["kind"] if media else None}}


def informative_groups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of groups whose rewards differ (the others have all-zero advantages)."""
    rewards: dict[str, list[float]] = {}
    for row in rows:
        rewards.setdefault(row["group_id"], []).append(row["reward"])
    keep = {g for g, values in rewards.items() if has_signal(values)}
    return [row for row in rows if row["group_id"] in keep]
