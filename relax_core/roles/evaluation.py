"""Held-out evaluation: greedy responses to the eval split, scored by the run's reward function."""

from __future__ import annotations

from typing import Any

from relax_core.data.prompts import PromptSource
from relax_core.rewards import RewardFn, score_batch
from relax_core.rollout.engine import RolloutEngine, SamplingParams


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    source: PromptSource,
    reward_fn: RewardFn,
    max_new_tokens: int,
    limit: int = 0,
) -> dict[str, float]:
    """Greedy pass@1 on the first `limit` eval prompts (0 = all): eval/accuracy, eval/reward_mean,
    and `eval/accuracy/<modality>` for each `meta.modality` the rows name (image, audio, ...)."""
    n = len(source.rows) if limit <= 0 else min(limit, len(source.rows))
    prompts = [source.prompt_ids(i) for i in range(n)]
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    if source.media is not None:
        media = [source.media_inputs(i) for i in range(n)]
        completions = engine.generate(prompts, params, media=media)
    else:
        completions = engine.generate(prompts, params)
    texts = tokenizer.batch_decode([c.response_ids for c in completions], skip_special_tokens=True)
    rows = source.rows[:n]
    results, errors = score_batch(reward_fn, texts, [r["answer"] for r in rows], rows)
    return {
        **accuracy_by_modality("eval", rows, [r.correct for r in results]),
        "eval/accuracy": sum(r.correct for r in results) / n,
        "eval/reward_mean": sum(r.reward for r in results) / n,
        "eval/response_length": sum(len(c.response_ids) for c in completions) / n,
        "eval/reward_errors": float(errors),
        "eval/size": float(n),
    }


def accuracy_by_modality(prefix: str, rows: list[dict[str, Any]], correct: list[bool]):
    """`{prefix}/accuracy/<modality>` over the rows whose `meta.modality` names one."""
    by: dict[str, list[bool]] = {}
    for row, ok in zip(rows, correct, strict=True):
        modality = (row.get("meta") or {}).get("modality")
        if modality:
            by.setdefault(str(modality), []).append(bool(ok))
    return {f"{prefix}/accuracy/{m}": sum(v) / len(v) for m, v in sorted(by.items())}
