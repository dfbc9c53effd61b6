"""Demonstration episodes for a supervised warm start of a multi-turn policy.

A demonstration is the list of a correct episode's model turns (each env module's
`demonstration(sample)`). Played through `run_episodes` against the real env with a scripted
engine, it becomes exactly the token layout RL will sample: observations rendered by the same
renderer, loss_mask 1 on the model's turns (and the EOS closing each) and 0 on observations, so
the warm start's cross-entropy over masked tokens learns the turns, never the env's text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from relax_core.envs.protocol import EnvFactory
from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.multiturn import Episode, EpisodeLimits, run_episodes
from relax_core.rollout.observations import ObservationRenderer


class _ScriptedTurns:
    """Hands out one episode's turns in order, each closed by EOS, as if sampled."""

    def __init__(self, turn_ids: list[list[int]]) -> None:
        self.turn_ids, self.next = turn_ids, 0

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        if len(prompts) != 1:
            raise ValueError("a demonstration is replayed one episode at a time")
        if self.next >= len(self.turn_ids):
            raise ValueError(
                f"the demonstration has {len(self.turn_ids)} turns, but the env asked for more"
            )
        ids = self.turn_ids[self.next]
        self.next += 1
        return [Completion(ids, [0.0] * len(ids), "stop", policy_version=0)]


def demonstration_episode(
    tokenizer: Any,
    env_factory: EnvFactory,
    sample: Mapping[str, Any],
    prompt_ids: Sequence[int],
    turns: Sequence[str],
    limits: EpisodeLimits,
    render: ObservationRenderer,
) -> Episode:
    """The episode of `turns` (texts, without EOS) for `sample`. Train on
    (prompt_ids, episode.response_ids, episode.loss_mask); check `episode.correct` and
    `episode.end_reason == "done"` to refuse a demonstration the env does not accept, or one
    `limits` cut short."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no EOS token to close a demonstration's turns")
    turn_ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) + [eos] for t in turns]
    params = SamplingParams(max_new_tokens=max((len(t) for t in turn_ids), default=1))
    engine = _ScriptedTurns(turn_ids)
    return run_episodes(
        engine, tokenizer, env_factory, [sample], [list(prompt_ids)], params, limits, render
    )[0]
