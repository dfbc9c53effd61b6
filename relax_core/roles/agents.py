"""Rollout and held-out eval of an agent run (`env.agent` set): a user's agent per episode, calling
the engine through the OpenAI-compatible endpoint, its calls recorded as queue rows.

Parts: an AgentEndpoint (agents/server.py, started once per process on loopback), an
EngineBatcher per rollout (the engine's one caller), the user's agent function run in up to
`env.agent_workers` threads with `env.agent_timeout_s` each, and the recorder's trajectories
turned into rows. An episode's segments (agents/recorder.py) become one row each: the first keeps
the sample's uid, the k-th adds `/seg{k}`; they share the episode's reward, and the advantages
role counts the episode once in its group's statistics (`episode_uid`). AgentRunner has the
EnvRunner's `rollout` and `evaluate`, so the colocate controller, the rollout service and the
async trainer's eval take either.

How an episode ends (end_reason -> finish_reason of its last row; earlier segments 'stop'):
- "done": the agent returned -> its last call's finish ('stop', or 'length' at the token cap);
- "max_turns" / "token_budget" / "context": the endpoint refused a call past env.max_turns
  calls, env.max_episode_tokens response tokens, or the policy's context -> 'stop' / 'length'
  / 'length'; the agent's reward still counts if it returned one (0 if it raised);
- "agent_error" / "timeout": the agent raised, returned something malformed, or ran past
  env.agent_timeout_s -> 'abort', reward 0 and loss_mask 0 (an infrastructure failure is not
  a judgement of the model's tokens); counted in rollout/agent_errors, rollout/agent_timeouts.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_core.agents.agent import AgentFn, AgentResult, call_agent, parse_result
from relax_core.agents.batcher import EngineBatcher
from relax_core.agents.recorder import Segment
from relax_core.agents.server import SERVED_MODEL, AgentEndpoint, CallLimits, EpisodeCalls
from relax_core.algorithms.dapo import overlong_penalty
from relax_core.data.prompts import PromptItem, PromptSource
from relax_core.roles.rollout import SEGMENT_SEP, group_columns, rollout_metrics
from relax_core.rollout.engine import RolloutEngine, SamplingParams
from relax_core.train.agent_failures import all_failed

log = logging.getLogger(__name__)

END_REASONS = ("done", "max_turns", "token_budget", "context", "agent_error", "timeout")
_FAILED = ("agent_error", "timeout")


@dataclass
class AgentEpisode:
    segments: list[Segment]
    end_reason: str
    result: AgentResult | None
    error: str = ""
    sampling_overrides: int = 0
    calls: int = 0
    tool_parse_errors: int = 0

    @property
    def reward(self) -> float:
        return 0.0 if self.result is None or self.failed else self.result.reward

    @property
    def correct(self) -> bool:
        return self.result is not None and not self.failed and self.result.correct

    @property
    def failed(self) -> bool:
        return self.end_reason in _FAILED

    def tool_counts(self) -> tuple[int, int]:
        info = self.result.info if self.result is not None else {}
        calls, valid = info.get("tool_calls"), info.get("tool_calls_valid")
        if not isinstance(calls, int) or not isinstance(valid, int):
            return 0, 0
        return calls, valid


@dataclass
class AgentRunner:
    """What one run's agent episodes need besides an engine and prompts."""

    agent: AgentFn
    tokenizer: Any
    limits: CallLimits
    workers: int
    timeout_s: float
    overlong_buffer: int = 0
    overlong_penalty_max: float = 0.0
    stop_when_eval_fails: bool = True
    """A held-out eval whose every episode failed raises AgentsFailed (env.max_failed_agent_steps
    > 0)."""
    tool_parser: str = "hermes"
    """env.tool_parser: how the endpoint reads tool calls in replies."""
    _endpoint: AgentEndpoint | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> AgentEndpoint:
        if self._endpoint is None:
            # An OpenAI client logs every request at INFO: thousands of lines a step in the run log.
            for name in ("httpx", "httpx2"):
                logging.getLogger(name).setLevel(logging.WARNING)
            self._endpoint = AgentEndpoint(self.tokenizer, tool_parser=self.tool_parser)
            log.info("agent endpoint serving on %s", self._endpoint.url)
        return self._endpoint

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None

    def episodes(
        self, engine: RolloutEngine, samples: Sequence[dict[str, Any]], params: SamplingParams
    ) -> list[AgentEpisode]:
        """Run the agent once per sample (at most `workers` at once); results in input order.
        An engine failure during any call raises after the episodes end (the role retries)."""
        endpoint = self.endpoint
        limits = CallLimits(
            self.limits.max_calls,
            self.limits.max_episode_tokens,
            params.max_new_tokens,
            _context(self.limits.context, engine),
        )
        running: dict[int, tuple[str, float]] = {}
        batcher = EngineBatcher(engine, params, waiting_for=lambda: len(running))
        done: queue.Queue[tuple[int, AgentResult | None, str]] = queue.Queue()
        out: list[AgentEpisode | None] = [None] * len(samples)
        pending = deque(range(len(samples)))
        try:
            while pending or running:
                while pending and len(running) < self.workers:
                    i = pending.popleft()
                    eid, base_url = endpoint.open_episode(batcher, limits)
                    running[i] = (eid, time.monotonic())
                    args = (i, samples[i], base_url, endpoint.token, done)
                    threading.Thread(target=self._play, args=args, daemon=True).start()
                first_deadline = min(start for _, start in running.values()) + self.timeout_s
                try:
                    i, result, error = done.get(timeout=max(0.0, first_deadline - time.monotonic()))
                    if i in running:
                        eid, _ = running.pop(i)
                        out[i] = _episode(endpoint.close_episode(eid), result, error)
                except queue.Empty:
                    pass
                now = time.monotonic()
                for i, (eid, start) in list(running.items()):
                    if now - start >= self.timeout_s:
                        del running[i]
                        message = f"the agent ran past env.agent_timeout_s ({self.timeout_s}s)"
                        out[i] = _episode(endpoint.close_episode(eid), None, message, "timeout")
        finally:
            batcher.close()
            for eid, _ in running.values():
                endpoint.close_episode(eid)
        episodes = [ep for ep in out if ep is not None]
        errors = [ep for ep in episodes if ep.failed]
        if errors:
            log.warning(
                "%d of %d agent episodes failed; first: %s",
                len(errors),
                len(episodes),
                errors[0].error,
            )
        return episodes

    def _play(self, i, sample, base_url, api_key, done) -> None:
        try:
            value = call_agent(self.agent, sample, base_url, api_key, SERVED_MODEL)
            done.put((i, parse_result(value), ""))
        except BaseException as err:  # noqa: BLE001 - a crashing agent costs its episode
            done.put((i, None, f"{type(err).__name__}: {err}"[:500]))

    def rollout(
        self, engine: RolloutEngine, items: list[PromptItem], params: SamplingParams, n_samples: int
    ) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """One episode per sample, `n_samples` per prompt item; queue rows and metrics (what
        `rollout.rollout_groups` returns, plus `rollout/` episode metrics)."""
        t0 = time.perf_counter()
        picks = [item for item in items for _ in range(n_samples)]
        eps = self.episodes(engine, [item.row for item in picks], params)
        t1 = time.perf_counter()
        version = getattr(engine, "version", 0)
        rows: list[dict[str, Any]] = []
        firsts: list[dict[str, Any]] = []
        for k, (item, ep) in enumerate(zip(picks, eps, strict=True)):
            ep_rows = self._rows(group_columns(item, k % n_samples), item, ep, version)
            firsts.append(ep_rows[0])
            rows += ep_rows
        metrics = rollout_metrics(firsts)
        metrics.update(agent_metrics(eps, "rollout"))
        metrics.update(
            {
                "train/reward_errors": float(sum(ep.failed for ep in eps)),
                "perf/generate_s": t1 - t0,
                "perf/reward_s": 0.0,
                "perf/generated_tokens": float(sum(sum(r["loss_mask"]) for r in rows)),
            }
        )
        return rows, metrics

    def _rows(
        self, base: dict[str, Any], item: PromptItem, ep: AgentEpisode, version: int
    ) -> list[dict[str, Any]]:
        info: dict[str, Any] = {
            "correct": ep.correct,
            "end_reason": ep.end_reason,
            "calls": ep.calls,
            "segments": len(ep.segments),
            "agent_info": ep.result.info if ep.result is not None else {},
        }
        if ep.error:
            info["agent_error"] = ep.error
        segments = ep.segments or [Segment(list(item.prompt_ids))]
        rows = []
        for j, seg in enumerate(segments):
            last = j == len(segments) - 1
            finish = "stop"
            if last and ep.failed:
                finish = "abort"
            elif last and (
                ep.end_reason in ("token_budget", "context") or seg.finish_reason == "length"
            ):
                finish = "length"
            reward, row_info = ep.reward, {**info, "segment": j}
            penalty = overlong_penalty(
                len(seg.response_ids),
                self.limits.max_episode_tokens,
                self.overlong_buffer,
                self.overlong_penalty_max,
            )
            if penalty:
                reward -= penalty
                row_info["overlong_penalty"] = penalty
            mask = [0] * len(seg.loss_mask) if ep.failed else seg.loss_mask
            rows.append(
                {
                    **base,
                    "uid": base["uid"] if j == 0 else f"{base['uid']}{SEGMENT_SEP}{j}",
                    "prompt_ids": seg.prompt_ids,
                    "response_ids": seg.response_ids,
                    "loss_mask": mask,
                    "rollout_logprobs": seg.logprobs,
                    "reward": reward,
                    "reward_info": row_info,
                    "finish_reason": finish,
                    "behaviour_version_min": min(seg.versions, default=version),
                    "behaviour_version_max": max(seg.versions, default=version),
                    "turns": seg.calls,
                    "media": None,
                }
            )
        return rows

    def evaluate(
        self, engine: RolloutEngine, source: PromptSource, max_new_tokens: int, limit: int = 0
    ) -> dict[str, float]:
        """Greedy episodes on the first `limit` eval prompts (0 = all): eval/success_rate,
        eval/mean_calls, ...; eval/accuracy is the success rate."""
        n = len(source.rows) if limit <= 0 else min(limit, len(source.rows))
        params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        eps = self.episodes(engine, source.rows[:n], params)
        if self.stop_when_eval_fails:
            all_failed([ep.error for ep in eps if ep.failed], len(eps), "the held-out eval")
        metrics = agent_metrics(eps, "eval")
        metrics.update(
            {
                "eval/accuracy": metrics["eval/success_rate"],
                "eval/reward_mean": sum(ep.reward for ep in eps) / max(1, n),
                "eval/response_length": sum(
                    sum(len(s.response_ids) for s in ep.segments) for ep in eps
                )
                / max(1, n),
                "eval/size": float(n),
            }
        )
        return metrics


def _episode(
    rec: EpisodeCalls, result: AgentResult | None, error: str, reason: str = ""
) -> AgentEpisode:
    if not reason:
        reason = rec.limit_reached or ("done" if result is not None else "agent_error")
    if rec.engine_error is not None:
        raise RuntimeError(
            f"the engine failed while serving an agent: {type(rec.engine_error).__name__}: "
            f"{rec.engine_error}"
        ) from rec.engine_error
    return AgentEpisode(
        list(rec.trajectory.segments),
        reason,
        result,
        error,
        rec.sampling_overrides,
        rec.trajectory.calls,
        rec.tool_parse_errors,
    )


def _context(configured: int | None, engine: RolloutEngine) -> int | None:
    """The positions a call may fill: the policy's, and a server engine's own where it says."""
    served = engine.context() if callable(getattr(engine, "context", None)) else None
    known = [c for c in (configured, served) if c]
    return min(known) if known else None


def agent_metrics(episodes: Sequence[AgentEpisode], prefix: str) -> dict[str, float]:
    """`{prefix}/success_rate`, calls, segments and model tokens per episode, agent errors and
    timeouts, tool-call validity (from the agents' info), and the share of each end reason."""
    n = max(1, len(episodes))
    tools = [ep.tool_counts() for ep in episodes]
    calls = sum(c for c, _ in tools)
    metrics = {
        f"{prefix}/success_rate": sum(ep.correct for ep in episodes) / n,
        f"{prefix}/mean_calls": sum(ep.calls for ep in episodes) / n,
        f"{prefix}/mean_turns": sum(ep.calls for ep in episodes) / n,
        f"{prefix}/segments_per_episode": sum(len(ep.segments) for ep in episodes) / n,
        f"{prefix}/model_tokens": sum(sum(sum(s.loss_mask) for s in ep.segments) for ep in episodes)
        / n,
        f"{prefix}/agent_errors": float(sum(ep.end_reason == "agent_error" for ep in episodes)),
        f"{prefix}/agent_timeouts": float(sum(ep.end_reason == "timeout" for ep in episodes)),
        f"{prefix}/sampling_overrides": float(sum(ep.sampling_overrides for ep in episodes)),
        f"{prefix}/tool_calls": calls / n,
        f"{prefix}/tool_parse_errors": float(sum(ep.tool_parse_errors for ep in episodes)),
    }
    if calls:
        metrics[f"{prefix}/tool_call_validity"] = sum(v for _, v in tools) / calls
    for reason in END_REASONS:
        metrics[f"{prefix}/end/{reason}"] = sum(ep.end_reason == reason for ep in episodes) / n
    return metrics
