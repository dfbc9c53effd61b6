"""Multi-turn agent loop: model turn -> env step -> observation appended -> next model turn.

Pure of I/O: an engine (RolloutEngine-like `generate(prompts, params, media=None)`), a tokenizer,
an env factory (one env per episode, envs/protocol.py) and an ObservationRenderer
(rollout/observations.py). All live episodes take their turn together: one `generate` call per
turn, so a step's groups (n prompts x k samples) cost as many engine calls as the longest episode
has turns.

An episode's tokens after its prompt (the row's `response_ids`):
    [turn 1 ... EOS][observation 1][turn 2 ... EOS][observation 2] ... [turn k ... EOS]
`loss_mask` is 1 on model tokens (EOS included: ending a turn is the model's action) and 0 on
observation tokens; `rollout_logprobs` holds the engine's log-prob of each model token and 0.0 on
observation tokens. Turn t is generated from prompt + response so far, exactly the sequence the
trainer scores, so rollout and trainer log-probs agree token by token.

How an episode ends (end_reason -> finish_reason):
- "done" -> stop: a turn ended on EOS and the env said done. This is how EOS ends an episode: a
  turn is always closed by EOS, and the env then judges it, ending the episode or asking for more
  (the calculator reads a turn without a tool call as the final answer);
- "max_turns" -> stop: the env asked for more after max_turns turns (its last observation is
  not appended: no turn would read it);
- "turn_length" / "token_budget" -> length (truncated): a turn stopped without EOS at its cap,
  per-turn `max_new_tokens` or what is left of `max_episode_tokens`; an unfinished turn is never
  shown to the env. "token_budget" also ends an episode whose next observation and one more
  model token would not fit, so a response never exceeds the budget;
- "env_error" -> abort: the env raised or returned a malformed step; only that episode ends, its
  EnvFailure in `reward_info["env_error"]`;
- "engine_abort" -> abort: the engine aborted the turn.
The episode's reward is the sum of its per-turn rewards (`reward_info["turn_rewards"]`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from relax_core.envs.protocol import (
    INFO_CORRECT,
    INFO_TOOL_CALL_VALID,
    EnvFactory,
    EnvFailure,
    as_step_result,
)
from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.observations import ObservationRenderer

FINISH_OF_END = {
    "done": "stop",
    "max_turns": "stop",
    "turn_length": "length",
    "token_budget": "length",
    "env_error": "abort",
    "engine_abort": "abort",
}
END_REASONS = tuple(FINISH_OF_END)


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    """Model turns per episode."""
    max_episode_tokens: int
    """Response tokens per episode, model and observation tokens together."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_episode_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Episode:
    """One finished episode: the row columns the loop fills, and what metrics read."""

    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    turns: int
    """Model turns taken (a turn cut by the budget counts)."""
    turn_rewards: list[float]
    """The env's reward for each turn it judged."""
    turn_info: list[dict[str, Any]]
    """The env's info for each turn it judged, JSON-able."""
    end_reason: str
    """One of END_REASONS."""
    correct: bool
    """The env's `correct` on the step that ended the episode ('done' only)."""
    behaviour_version_min: int | None
    """Oldest weights version that generated a token; None when no turn was generated."""
    behaviour_version_max: int | None
    media: list[dict[str, Any]] = field(default_factory=list)
    """Media the env showed, as row-schema items, in the order their placeholders appear."""
    error: EnvFailure | None = None

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    @property
    def finish_reason(self) -> str:
        return FINISH_OF_END[self.end_reason]

    @property
    def tool_calls(self) -> int:
        return sum(INFO_TOOL_CALL_VALID in info for info in self.turn_info)

    @property
    def tool_calls_valid(self) -> int:
        return sum(info.get(INFO_TOOL_CALL_VALID) is True for info in self.turn_info)

    def reward_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "correct": self.correct,
            "end_reason": self.end_reason,
            "turn_rewards": self.turn_rewards,
            "tool_calls": self.tool_calls,
            "tool_calls_valid": self.tool_calls_valid,
            "turn_info": self.turn_info,
        }
        if self.error is not None:
            info["env_error"] = self.error.to_info()
        return info

    def row_fields(self, policy_version: int) -> dict[str, Any]:
        """The queue-row columns this episode fills (row schema names). `policy_version` stands
        in for the behaviour versions of an episode that generated nothing (its env failed at
        reset); such a row has an all-zero loss_mask and trains nothing."""
        low = policy_version if self.behaviour_version_min is None else self.behaviour_version_min
        high = policy_version if self.behaviour_version_max is None else self.behaviour_version_max
        return {
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "reward": self.reward,
            "reward_info": self.reward_info(),
            "finish_reason": self.finish_reason,
            "behaviour_version_min": low,
            "behaviour_version_max": high,
            "turns": self.turns,
        }


@dataclass
class _Live:
    """An episode while it runs."""

    prompt_ids: list[int]
    env: Any
    media_inputs: list
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    media: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    versions: list[int] = field(default_factory=list)
    end: str | None = None
    error: EnvFailure | None = None

    def fail(self, phase: str, err: Exception) -> None:
        self.error, self.end = EnvFailure.from_exception(phase, err), "env_error"

    def episode(self) -> Episode:
        if self.end is None:
            raise RuntimeError("the episode is still running")
        done = self.end == "done"
        return Episode(
            response_ids=self.response_ids,
            loss_mask=self.loss_mask,
            rollout_logprobs=self.logprobs,
            turns=self.turns,
            turn_rewards=self.rewards,
            turn_info=self.infos,
            end_reason=self.end,
            correct=done and self.infos[-1].get(INFO_CORRECT) is True,
            behaviour_version_min=min(self.versions, default=None),
            behaviour_version_max=max(self.versions, default=None),
            media=self.media,
            error=self.error,
        )


def run_episodes(
    engine: Any,
    tokenizer: Any,
    env_factory: EnvFactory,
    samples: Sequence[Mapping[str, Any]],
    prompt_ids: Sequence[Sequence[int]],
    params: SamplingParams,
    limits: EpisodeLimits,
    render: ObservationRenderer,
    media: Sequence[list] | None = None,
) -> list[Episode]:
    """Play one episode per (sample, prompt) with a fresh env each; results in input order.

    `params.max_new_tokens` caps each turn; `limits` cap turns and response tokens. `media`:
    each prompt's encoder inputs (an omni policy); observation media are added to them. An
    engine error propagates (the role retries the batch); an env error ends only its episode.
    """
    if len(samples) != len(prompt_ids) or (media is not None and len(media) != len(samples)):
        raise ValueError("samples, prompt_ids and media need one entry per episode")
    episodes = []
    for i, (sample, ids) in enumerate(zip(samples, prompt_ids, strict=True)):
        ep = _Live(list(ids), None, list(media[i]) if media is not None else [])
        _reset(ep, env_factory, sample, render, limits)
        episodes.append(ep)
    while live := [ep for ep in episodes if ep.end is None]:
        budget = limits.max_episode_tokens
        rooms = [min(params.max_new_tokens, budget - len(ep.response_ids)) for ep in live]
        prompts = [ep.prompt_ids + ep.response_ids for ep in live]
        call = dataclasses.replace(params, max_new_tokens=max(rooms))
        if media is not None or any(ep.media_inputs for ep in live):
            media_now = [list(ep.media_inputs) for ep in live]  # copies: episodes grow theirs
            completions = engine.generate(prompts, call, media=media_now)
        else:
            completions = engine.generate(prompts, call)
        if len(completions) != len(live):
            raise RuntimeError(f"engine returned {len(completions)} completions for {len(live)}")
        for ep, comp, room in zip(live, completions, rooms, strict=True):
            _take_turn(ep, comp, room, tokenizer, render, limits)
    return [ep.episode() for ep in episodes]


def _reset(
    ep: _Live,
    env_factory: EnvFactory,
    sample: Mapping[str, Any],
    render: ObservationRenderer,
    limits: EpisodeLimits,
) -> None:
    try:
        ep.env = env_factory()
        observation = ep.env.reset(sample)
    except Exception as err:  # noqa: BLE001 - a broken env costs its episode, not the run
        ep.fail("reset", err)
        return
    if observation is not None:
        _observe(ep, observation, render, limits)


def _take_turn(
    ep: _Live,
    comp: Completion,
    room: int,
    tokenizer: Any,
    render: ObservationRenderer,
    limits: EpisodeLimits,
) -> None:
    ids, logprobs, finish = list(comp.response_ids), list(comp.logprobs), comp.finish_reason
    if len(ids) > room:
        # The batch's cap fits its roomiest episode; a token sequence cut after `room` tokens is
        # exactly a sample generated with cap `room`, so the cut needs no second generate call.
        ids, logprobs, finish = ids[:room], logprobs[:room], "length"
    ep.response_ids += ids
    ep.loss_mask += [1] * len(ids)
    ep.logprobs += [float(x) for x in logprobs]
    ep.turns += 1
    high = comp.policy_version if comp.policy_version_max is None else comp.policy_version_max
    ep.versions += [comp.policy_version, high]
    if finish == "abort":
        ep.end = "engine_abort"
        return
    if finish != "stop":
        full = len(ep.response_ids) >= limits.max_episode_tokens
        ep.end = "token_budget" if full else "turn_length"
        return
    text = tokenizer.decode(ids, skip_special_tokens=True)
    try:
        result = as_step_result(ep.env.step(text))
    except Exception as err:  # noqa: BLE001 - a broken env costs its episode, not the run
        ep.fail("step", err)
        return
    ep.rewards.append(result.reward)
    ep.infos.append(_jsonable(result.info))
    if result.done:
        ep.end = "done"
    elif ep.turns >= limits.max_turns:
        ep.end = "max_turns"
    else:
        _observe(ep, result.observation, render, limits)


def _observe(
    ep: _Live, observation: Any, render: ObservationRenderer, limits: EpisodeLimits
) -> None:
    try:
        rendered = render(ep.env.format_observation(observation))
    except Exception as err:  # noqa: BLE001 - a broken env costs its episode, not the run
        ep.fail("format_observation", err)
        return
    if len(ep.response_ids) + len(rendered.ids) + 1 > limits.max_episode_tokens:
        ep.end = "token_budget"
        return
    ep.response_ids += rendered.ids
    ep.loss_mask += [0] * len(rendered.ids)
    ep.logprobs += [0.0] * len(rendered.ids)
    ep.media += rendered.media
    ep.media_inputs += rendered.media_inputs


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    """`info` as it will read back from the row's JSON; anything unencodable becomes its repr."""
    try:
        return json.loads(json.dumps(info, default=repr))
    except (TypeError, ValueError):  # e.g. tuple keys
        return {"unencodable_info": repr(info)[:500]}


def episode_metrics(episodes: Sequence[Episode], prefix: str) -> dict[str, float]:
    """`{prefix}/success_rate`, mean turns, model tokens, tool calls per episode and their
    validity, env errors, and the share of each end reason."""
    n = max(1, len(episodes))
    calls = sum(ep.tool_calls for ep in episodes)
    metrics = {
        f"{prefix}/success_rate": sum(ep.correct for ep in episodes) / n,
        f"{prefix}/mean_turns": sum(ep.turns for ep in episodes) / n,
        f"{prefix}/model_tokens": sum(sum(ep.loss_mask) for ep in episodes) / n,
        f"{prefix}/tool_calls": calls / n,
        f"{prefix}/env_errors": float(sum(ep.error is not None for ep in episodes)),
    }
    if calls:
        valid = sum(ep.tool_calls_valid for ep in episodes)
        metrics[f"{prefix}/tool_call_validity"] = valid / calls
    for reason in END_REASONS:
        metrics[f"{prefix}/end/{reason}"] = sum(ep.end_reason == reason for ep in episodes) / n
    return metrics
