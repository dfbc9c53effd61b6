"""Warm-start examples of an agent run: the user's agent playing against a scripted policy.

An agent module may define, beside its agent function, `demonstration(sample) -> list[str]`:
the model's turns of a correct episode (e.g. a `<tool_call>` block, then the answer), as an env
module does for the env loop. Each is replayed through the real endpoint and the user's agent,
a scripted engine answering the agent's calls with those turns in order (each closed by EOS). The
row that comes out is the token layout RL samples: the agent's own system prompt, tools and
messages rendered by the run's chat template, its tool results between the calls (loss_mask 0),
the turns under loss_mask 1. It is kept when the agent judged the episode correct and it is one
segment; the warm start learns the kept ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from relax_core.agents.agent import load_agent
from relax_core.agents.server import CallLimits
from relax_core.roles.agents import AgentRunner
from relax_core.rollout.engine import Completion, SamplingParams

DEMONSTRATION = "demonstration"
Example = tuple[list[int], list[int], list[int]]


def demonstration_of(agent_spec: str) -> Callable[[dict], list[str]] | None:
    """The `demonstration` function of the module `agent_spec` ('module:function') names, or
    None when it defines none (the module is importable: load_agent checked it)."""
    module = importlib.import_module(agent_spec.partition(":")[0].strip())
    found = getattr(module, DEMONSTRATION, None)
    return found if callable(found) else None


class ScriptedTurns:
    """Answers each call with the next turn's ids (EOS appended), cut at the call's cap."""

    version = 0

    def __init__(self, turn_ids: list[list[int]], eos: int) -> None:
        self.turns, self.eos, self.next = turn_ids, eos, 0

    def generate(self, prompts: list[list[int]], params: SamplingParams, media=None):
        out = []
        for _ in prompts:
            ids = [*self.turns[self.next], self.eos] if self.next < len(self.turns) else [self.eos]
            self.next += 1
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            out.append(Completion(ids, [0.0] * len(ids), finish, policy_version=0))
        return out


def replay(
    runner: AgentRunner,
    demonstration: Callable[[dict], list[str]],
    rows: Sequence[dict[str, Any]],
    want: int,
    max_new_tokens: int,
) -> list[Example]:
    """Up to `want` examples (prompt ids, response ids, loss mask) from the first rows whose
    demonstration the agent judges correct in one segment, one episode at a time."""
    tok = runner.tokenizer
    params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
    examples: list[Example] = []
    for row in rows:
        if len(examples) >= want:
            break
        turns = [tok(t, add_special_tokens=False)["input_ids"] for t in demonstration(row)]
        (ep,) = runner.episodes(ScriptedTurns(turns, tok.eos_token_id), [row], params)
        if ep.correct and ep.end_reason == "done" and len(ep.segments) == 1:
            seg = ep.segments[0]
            examples.append((list(seg.prompt_ids), list(seg.response_ids), list(seg.loss_mask)))
    return examples


def agent_demonstration_examples(env, tokenizer: Any, rows: list[dict], want: int) -> list[Example]:
    """Warm-start examples of an agent run (`env`: its EnvConfig; `tokenizer` with the run's chat
    template); ValueError naming the setting when there are none."""
    demonstration = demonstration_of(env.agent)
    if demonstration is None:
        raise ValueError(
            f"warm_start.steps: env.agent {env.agent!r}: its module defines no "
            f"{DEMONSTRATION}(sample) to warm-start on; add one (docs/agents.md) or use steps: 0"
        )
    limits = CallLimits(env.max_turns, env.max_episode_tokens, env.max_episode_tokens)
    runner = AgentRunner(
        load_agent(env.agent),
        tokenizer,
        limits,
        1,
        env.agent_timeout_s,
        tool_parser=env.tool_parser,
    )
    try:
        examples = replay(runner, demonstration, rows, want, env.max_episode_tokens)
    finally:
        runner.close()
    if not examples:
        raise ValueError(
            f"warm_start.steps: no demonstration of env.agent {env.agent!r} ended correct in one "
            f"segment within env.max_turns {env.max_turns} and env.max_episode_tokens "
            f"{env.max_episode_tokens} ({len(rows)} rows tried)"
        )
    return examples
