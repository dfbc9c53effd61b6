"""Held-out evaluation: greedy responses to the eval split, scored by the run's reward function."""

from __future__ import annotations

from typing import Any

from relax_core.rewards import RewardFn, score_batch
from relax_core.rollout.engine import RolloutEngine, SamplingParams
from relax_core.services.prompts import PromptSource


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    source: PromptSource,
    reward_fn: RewardFn,
    max_new_tokens: int,
    limit: int = 0,
) -> dict[str, float]:
    """Greedy pass@1 on the first `limit` eval prompts (0 = all): eval/accuracy, eval/reward_mean."""
    n = len(source.rows) if limit <= 0 else min(limit, len(source.rows))
    prompts = [source.prompt_ids(i) for i in range(n)]
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    completions = engine.generate(prompts, params)
    texts = tokenizer.batch_decode([c.response_ids for c in completions], skip_special_tokens=True)
    rows = source.rows[:n]
    results, errors = score_batch(reward_fn, texts, [r["answer"] for r in rows], rows)
    return {
        "eval/accuracy": sum(r.correct for r in results) / n,
        "eval/reward_mean": sum(r.reward for r in results) / n,
        "eval/response_length": sum(len(c.response_ids) for c in completions) / n,
        "eval/reward_errors": float(errors),
        "eval/size": float(n),
    }
