"""Rollout and held-out eval of an agentic run (`env.name` set): multi-turn episodes as rows.

Parts: an EnvRunner holds what a run's episodes need (env factory, episode limits, observation
renderer) and hands groups of prompts to `rollout/multiturn.run_episodes`; each episode becomes a
queue row like a single-turn sample (same uid/group columns; `loss_mask` 0 on observation tokens,
`turns` filled), so advantages, training and both modes need nothing else. The env's rewards
replace the reward function's. The colocate controller, the rollout service and the async trainer's
eval build one with `env_runner(cfg, model, tokenizer)`; it is None for a single-turn run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from relax_core.agents.agent import load_agent
from relax_core.agents.server import CallLimits
from relax_core.algorithms.dapo import overlong_penalty
from relax_core.config import RunConfig
from relax_core.config.checks import TINY_POSITIONS
from relax_core.data.prompts import PromptItem, PromptSource
from relax_core.envs import EnvFactory, resolve_env
from relax_core.roles.agent_demos import DEMONSTRATION, demonstration_of
from relax_core.roles.agents import AgentRunner
from relax_core.roles.rollout import group_columns, rollout_metrics
from relax_core.rollout.engine import RolloutEngine, SamplingParams
from relax_core.rollout.multiturn import Episode, EpisodeLimits, episode_metrics, run_episodes
from relax_core.rollout.observations import ObservationRenderer


def check_env(cfg: RunConfig) -> list[str]:
    """Preflight problems of `cfg.env`: an env or agent that cannot be loaded, or (a tiny
    policy, whose char tokenizer takes one token per character) prompts too long for an
    episode's budget."""
    if cfg.env.agent:
        try:
            load_agent(cfg.env.agent)
        except (ValueError, TypeError) as exc:
            return [str(exc)]
        if cfg.warm_start.steps and demonstration_of(cfg.env.agent) is None:
            return [
                f"warm_start.steps: env.agent {cfg.env.agent!r}: its module defines no "
                f"{DEMONSTRATION}(sample) to warm-start on; add one (docs/agents.md) or use 0"
            ]
        return []
    try:
        resolve_env(cfg.env.name, **cfg.env.kwargs)
    except (ValueError, TypeError) as exc:
        return [f"env.name: {exc}"]
    from relax_core.envs import DEMONSTRATIONS

    if cfg.warm_start.steps and cfg.env.name not in DEMONSTRATIONS:
        return [
            f"warm_start.steps: env {cfg.env.name!r} ships no demonstrations to warm-start on; "
            f"use steps: 0 or one of {', '.join(sorted(DEMONSTRATIONS))}"
        ]
    if cfg.model.kind not in ("tiny-qwen3", "tiny-omni"):
        return []
    from relax_core.data.dataset import load_prompts

    problems = []
    for name in ("train_path", "eval_path"):
        longest = max(
            (len(str(r["prompt"])) for r in load_prompts(getattr(cfg.data, name))), default=0
        )
        if longest + cfg.env.max_episode_tokens > TINY_POSITIONS:
            problems.append(
                f"env.max_episode_tokens: the longest prompt of data.{name} ({longest} tokens) "
                f"plus {cfg.env.max_episode_tokens} exceeds the tiny model's {TINY_POSITIONS} "
                "positions"
            )
    return problems


def policy_positions(cfg: RunConfig, model: Any) -> int | None:
    """Positions the policy takes (prompt + response): the tiny models', or the in-process
    policy's config; None when neither is known here (a server engine says its own)."""
    if cfg.model.kind in ("tiny-qwen3", "tiny-omni"):
        return TINY_POSITIONS
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and positions > 0 else None


def response_budget(cfg: RunConfig) -> int:
    """Most response tokens of a row: Dr. GRPO's fixed length and the overlong budget."""
    return cfg.env.max_episode_tokens if cfg.env.episodic else cfg.rollout.max_new_tokens


@dataclass(frozen=True)
class EnvRunner:
    """What one run's episodes need besides an engine and prompts."""

    env_factory: EnvFactory
    limits: EpisodeLimits
    render: ObservationRenderer
    tokenizer: Any
    overlong_buffer: int = 0
    overlong_penalty_max: float = 0.0

    def episodes(
        self,
        engine: RolloutEngine,
        samples: list[dict[str, Any]],
        prompt_ids: list[list[int]],
        params: SamplingParams,
        media: list | None,
    ) -> list[Episode]:
        return run_episodes(
            engine,
            self.tokenizer,
            self.env_factory,
            samples,
            prompt_ids,
            params,
            self.limits,
            self.render,
            media=media,
        )

    def rollout(
        self,
        engine: RolloutEngine,
        items: list[PromptItem],
        params: SamplingParams,
        n_samples: int,
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """One episode per sample, `n_samples` per prompt item; queue rows and metrics (what
        `rollout.rollout_groups` returns, plus `rollout/` episode metrics)."""
        t0 = time.perf_counter()
        picks = [item for item in items for _ in range(n_samples)]
        media = None
        if any(item.media is not None for item in items):
            media = [list(item.media or []) for item in picks]
        eps = self.episodes(
            engine, [i.row for i in picks], [i.prompt_ids for i in picks], params, media
        )
        t1 = time.perf_counter()
        budget = self.limits.max_episode_tokens
        rows = []
        version = getattr(engine, "version", 0)
        for k, (item, ep) in enumerate(zip(picks, eps, strict=True)):
            fields = ep.row_fields(version)
            penalty = overlong_penalty(
                len(ep.response_ids), budget, self.overlong_buffer, self.overlong_penalty_max
            )
            if penalty:
                fields["reward"] -= penalty
                fields["reward_info"]["overlong_penalty"] = penalty
            media = list(item.row.get("media") or []) + ep.media
            rows.append({**group_columns(item, k % n_samples), **fields, "media": media or None})
        metrics = rollout_metrics(rows)
        metrics.update(episode_metrics(eps, "rollout"))
        metrics.update(
            {
                "train/reward_errors": 0.0,
                "perf/generate_s": t1 - t0,
                "perf/reward_s": 0.0,
                "perf/generated_tokens": float(sum(sum(ep.loss_mask) for ep in eps)),
            }
        )
        return rows, metrics

    def evaluate(
        self, engine: RolloutEngine, source: PromptSource, max_new_tokens: int, limit: int = 0
    ) -> dict[str, float]:
        """Greedy episodes on the first `limit` eval prompts (0 = all): eval/success_rate,
        eval/mean_turns, eval/tool_call_validity, ...; eval/accuracy is the success rate."""
        n = len(source.rows) if limit <= 0 else min(limit, len(source.rows))
        media = None if source.media is None else [source.media_inputs(i) or [] for i in range(n)]
        params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        prompts = [source.prompt_ids(i) for i in range(n)]
        eps = self.episodes(engine, source.rows[:n], prompts, params, media)
        metrics = episode_metrics(eps, "eval")
        metrics.update(
            {
                "eval/accuracy": metrics["eval/success_rate"],
                "eval/reward_mean": sum(ep.reward for ep in eps) / max(1, n),
                "eval/response_length": sum(len(ep.response_ids) for ep in eps) / max(1, n),
                "eval/size": float(n),
            }
        )
        return metrics


def env_runner(cfg: RunConfig, model: Any, tokenizer: Any) -> EnvRunner | AgentRunner | None:
    """The run's EnvRunner (or AgentRunner, env.agent set); None for a single-turn run.
    `model`: the policy when it is in this process (a multimodal policy shows env media to its
    encoders), else None."""
    v = cfg.env
    if v.agent:
        return AgentRunner(
            load_agent(v.agent),
            tokenizer,
            CallLimits(
                v.max_turns,
                v.max_episode_tokens,
                cfg.rollout.max_new_tokens,
                policy_positions(cfg, model),
            ),
            v.agent_workers,
            v.agent_timeout_s,
            cfg.reward.overlong_buffer,
            cfg.reward.overlong_penalty,
            tool_parser=v.tool_parser,
            stop_when_eval_fails=v.max_failed_agent_steps > 0,
        )
    if not cfg.env.name:
        return None
    from relax_core.roles.media import placeholders_for

    media = placeholders_for(cfg, model)
    return EnvRunner(
        resolve_env(v.name, **v.kwargs),
        EpisodeLimits(v.max_turns, v.max_episode_tokens),
        ObservationRenderer(tokenizer, cfg.data.template, media),
        tokenizer,
        cfg.reward.overlong_buffer,
        cfg.reward.overlong_penalty,
    )
