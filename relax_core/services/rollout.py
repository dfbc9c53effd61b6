"""Rollout role: prompts -> engine samples -> rewards -> rows of whole groups for the `rollout` stage.

Parts: a PromptSource (dataset order), a RolloutEngine (tokens and log-probs), a reward function
(scored per sample; a raising reward costs that sample, not the run). The same function serves the
colocate controller and the standalone rollout service.
"""

from __future__ import annotations

import time
from typing import Any

from relax_core.rewards import RewardFn, score_batch
from relax_core.rollout.engine import RolloutEngine, SamplingParams
from relax_core.services.prompts import PromptItem


def rollout_groups(
    engine: RolloutEngine,
    tokenizer: Any,
    items: list[PromptItem],
    params: SamplingParams,
    n_samples: int,
    reward_fn: RewardFn,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Generate `n_samples` responses per prompt item; returns queue rows and rollout metrics."""
    t0 = time.perf_counter()
    prompts = [item.prompt_ids for item in items for _ in range(n_samples)]
    completions = engine.generate(prompts, params)
    t1 = time.perf_counter()
    texts = tokenizer.batch_decode([c.response_ids for c in completions], skip_special_tokens=True)
    samples = [item.row for item in items for _ in range(n_samples)]
    results, errors = score_batch(reward_fn, texts, [s["answer"] for s in samples], samples)
    t2 = time.perf_counter()
    rows = []
    for k, (comp, res) in enumerate(zip(completions, results, strict=True)):
        item = items[k // n_samples]
        group_id = f"e{item.epoch}-p{item.prompt_index}"
        rows.append(
            {
                "uid": f"{group_id}-s{k % n_samples}",
                "group_id": group_id,
                "prompt_index": item.prompt_index,
                "epoch": item.epoch,
                "prompt_ids": item.prompt_ids,
                "response_ids": comp.response_ids,
                "loss_mask": [1] * len(comp.response_ids),
                "rollout_logprobs": comp.logprobs,
                "reward": res.reward,
                "reward_info": {"correct": res.correct, **res.info},
                "finish_reason": comp.finish_reason,
                "behaviour_version_min": comp.policy_version,
                "behaviour_version_max": comp.policy_version,
                "turns": 1,
            }
        )
    n = len(rows)
    metrics = {
        "train/reward_mean": sum(r.reward for r in results) / n,
        "train/accuracy": sum(r.correct for r in results) / n,
        "train/response_length": sum(len(c.response_ids) for c in completions) / n,
        "train/truncated_frac": sum(c.finish_reason == "length" for c in completions) / n,
        "train/reward_errors": float(errors),
        "perf/generate_s": t1 - t0,
        "perf/reward_s": t2 - t1,
        "perf/generated_tokens": float(sum(len(c.response_ids) for c in completions)),
    }
    return rows, metrics
