"""Evaluate a checkpoint on the held-out split, as its own MLflow run nested under its training run.

Parts: what to evaluate (a checkpoint directory, or a registered model version `models:/...`
pinned and downloaded into the policy cache), its RunSession (policy, engine, reward, eval
prompts), the same greedy eval the training run logs (eval/accuracy = pass@1), a sampled pass@k
with the unbiased estimator over n samples per prompt, and an MLflowMonitor whose run carries `mlflow.parentRunId` = the training
run, so the MLflow UI shows the evaluation under the run that produced the weights.
"""

from __future__ import annotations

import math
from typing import Any

from relax_core.config import RunConfig
from relax_core.rewards import score_batch
from relax_core.rollout.engine import SamplingParams
from relax_core.storage import local_cache, where


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right: 1 - C(n-c, k) / C(n, k)."""
    if not 0 < k <= n or not 0 <= correct <= n:
        raise ValueError(
            f"pass@k needs 0 < k <= n and 0 <= correct <= n; got n={n} c={correct} k={k}"
        )
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def sampled_pass_at_k(session, n_samples: int, k: int, limit: int) -> dict[str, float]:
    """pass@k and mean reward over `n_samples` sampled responses per eval prompt."""
    source, cfg = session.eval_prompts, session.cfg
    n = len(source.rows) if limit <= 0 else min(limit, len(source.rows))
    prompts = [source.prompt_ids(i) for i in range(n) for _ in range(n_samples)]
    params = SamplingParams(cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.top_p)
    completions = session.engine.generate(prompts, params)
    texts = session.tokenizer.batch_decode(
        [c.response_ids for c in completions], skip_special_tokens=True
    )
    rows = [source.rows[i] for i in range(n) for _ in range(n_samples)]
    results, errors = score_batch(session.reward_fn, texts, [r["answer"] for r in rows], rows)
    per_prompt = [
        sum(r.correct for r in results[i * n_samples : (i + 1) * n_samples]) for i in range(n)
    ]
    return {
        f"eval/pass_at_{k}": sum(pass_at_k(n_samples, c, k) for c in per_prompt) / n,
        "eval/sampled_accuracy": sum(per_prompt) / (n * n_samples),
        "eval/sampled_reward_mean": sum(r.reward for r in results) / len(results),
        "eval/sampled_reward_errors": float(errors),
    }


def resolve_target(cfg: RunConfig, checkpoint: str, model: str) -> tuple[str, str]:
    """(local checkpoint directory, pinned models:/ URI or "") of what to evaluate: a checkpoint
    directory or a registered model version (downloaded once into the policy cache)."""
    if bool(checkpoint) == bool(model):
        raise ValueError(
            "evaluate: give exactly one of --checkpoint (a checkpoint directory) or --model "
            "(models:/<name>/<version>, models:/<name>/latest or models:/<name>@<alias>)"
        )
    if checkpoint:
        return checkpoint, ""
    from relax_core.tracking.registry import download_policy, resolve_model_uri
    from relax_core.tracking.runs import tracking_uri_of

    uri = tracking_uri_of(cfg)
    pinned = resolve_model_uri(uri, model).uri
    cache = local_cache(cfg, "registry")
    return download_policy(uri, pinned, cache), pinned


def evaluate_checkpoint(
    cfg: RunConfig, checkpoint: str = "", k: int = 8, n_samples: int = 8, model: str = ""
) -> dict[str, Any]:
    """Greedy pass@1, sampled pass@k and mean reward of `checkpoint` (a directory) or `model` (a
    registered version), logged to MLflow under the training run that produced the weights."""
    from relax_core.run.colocate import ColocateController
    from relax_core.run.session import RunSession
    from relax_core.tracking.mlflow_monitor import MLflowMonitor

    if not 0 < k <= n_samples:
        raise ValueError(f"evaluate: need 0 < k <= samples, got k={k}, samples={n_samples}")
    checkpoint, model_uri = resolve_target(cfg, checkpoint, model)
    session = RunSession.from_checkpoint(cfg, checkpoint, "evaluate")
    state = session.state
    metrics = ColocateController(session).evaluate()
    metrics.update(sampled_pass_at_k(session, n_samples, k, cfg.data.eval_size))
    monitor = MLflowMonitor(
        cfg.tracking.tracking_uri or None,
        cfg.tracking.experiment,
        run_name=f"eval-{state.run_id}-v{state.policy_version}",
    )
    tags = {
        "relax.kind": "evaluation",
        "relax.evaluates_run": state.run_id,
        "relax.checkpoint": where(checkpoint),
    }
    if model_uri:
        tags["relax.model_uri"] = model_uri
    if state.tracking_run_id:
        tags["mlflow.parentRunId"] = state.tracking_run_id
        tags["relax.training_mlflow_run"] = state.tracking_run_id
    params = {
        "checkpoint": model_uri or where(checkpoint),
        "k": k,
        "samples": n_samples,
        "eval_path": cfg.data.eval_path,
        "eval_size": cfg.data.eval_size,
    }
    monitor.start(params, tags)
    monitor.log_metrics(metrics, step=state.policy_version)
    monitor.finish("FINISHED")
    return {
        "checkpoint": model_uri or where(checkpoint),
        "policy_version": state.policy_version,
        "eval_accuracy": metrics["eval/accuracy"],
        "pass_at_k": metrics[f"eval/pass_at_{k}"],
        "k": k,
        "reward_mean": metrics["eval/sampled_reward_mean"],
        "mlflow_run_id": monitor.run_id,
        "training_mlflow_run_id": state.tracking_run_id,
    }
