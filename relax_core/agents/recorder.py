"""Calls an episode's agent made through the endpoint -> token-exact trajectories (pure).

Every call is kept as the engine saw it: the prompt ids as rendered and the ids it sampled, with
their log-probs and weights versions. A call whose prompt starts with everything its trajectory
holds so far (the previous prompt + sampled tokens) extends it: the tokens between are the
observation (loss_mask 0), its sampled tokens follow (loss_mask 1). A call whose prompt does not
(the agent rewrote, summarised or re-templated its history) starts a new segment with that
prompt; its tokens are never re-tokenized to fit the old one. Each segment becomes one queue row:
    segment.prompt_ids = the first call's prompt
    segment.response_ids = [sampled 1][observation][sampled 2] ... [sampled k]
so the trainer scores exactly the tokens the engine produced, from the context it produced them
in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One engine call as the engine saw it."""

    prompt_ids: list[int]
    """The prompt as rendered (and extended token-exactly) by the endpoint."""
    response_ids: list[int]
    """The sampled ids (EOS included when generation stopped on it)."""
    logprobs: list[float]
    """The engine's log-prob of each sampled id."""
    finish_reason: str
    """'stop' (EOS) or 'length'."""
    version_min: int
    """Weights version of the first sampled token."""
    version_max: int
    """Weights version of the last sampled token."""


@dataclass
class Segment:
    """Calls whose prompts extend one another: one queue row."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    calls: int = 0
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "stop"

    @property
    def tokens(self) -> list[int]:
        """Everything the segment holds, prompt first: what an extending call's prompt starts
        with."""
        return self.prompt_ids + self.response_ids

    def add(self, gap: Sequence[int], call: Call) -> None:
        self.response_ids += list(gap) + list(call.response_ids)
        self.loss_mask += [0] * len(gap) + [1] * len(call.response_ids)
        self.logprobs += [0.0] * len(gap) + [float(x) for x in call.logprobs]
        self.calls += 1
        self.versions += [call.version_min, call.version_max]
        self.finish_reason = call.finish_reason


class Trajectory:
    """An episode's segments, built call by call."""

    def __init__(self) -> None:
        self.segments: list[Segment] = []

    def gap(self, prompt_ids: Sequence[int]) -> list[int] | None:
        """The tokens `prompt_ids` adds to the current segment, or None when it does not extend
        it (a new segment starts)."""
        if not self.segments:
            return None
        held = self.segments[-1].tokens
        if len(prompt_ids) < len(held) or list(prompt_ids[: len(held)]) != held:
            return None
        return list(prompt_ids[len(held) :])

    def response_tokens_after(self, prompt_ids: Sequence[int]) -> int:
        """Response tokens the row would hold once `prompt_ids` is its context: what counts
        against the episode's token budget before the call samples anything."""
        gap = self.gap(prompt_ids)
        if gap is None:
            return 0
        return len(self.segments[-1].response_ids) + len(gap)

    def add(self, call: Call) -> None:
        if len(call.response_ids) != len(call.logprobs):
            raise ValueError(
                f"a call sampled {len(call.response_ids)} ids but has {len(call.logprobs)} "
                "log-probs"
            )
        gap = self.gap(call.prompt_ids)
        if gap is None:
            self.segments.append(Segment(list(call.prompt_ids)))
            gap = []
        self.segments[-1].add(gap, call)

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.segments)
