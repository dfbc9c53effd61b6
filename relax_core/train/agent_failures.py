"""A run whose agents all fail ends, loudly (pure).

A step whose every episode ended in `agent_error` or `timeout` trains nothing (their loss_mask is
all 0). One such step can be bad luck (a tool server restarting); `env.max_failed_agent_steps` in
a row means the agent cannot run at all (every call refused with 400, a missing dependency), and
the run stops with the first agent error of the step instead of spending its budget on nothing.
The count of such steps in a row lives in the run's state (RunState.failed_agent_steps), so it
survives checkpoints, Flyte nodes (`train.steps_per_node`) and trainer restarts alike. A held-out
eval whose every episode failed stops the run at once (`all_failed`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

FAILED_END_REASONS = ("agent_error", "timeout")
SETTING = "env.max_failed_agent_steps"


class AgentsFailed(RuntimeError):
    """Every agent episode failed for too long: the run stops (no restart, no retry)."""

    exit_code = 76
    """What a role process exits with on it, so its supervisor stops the run instead of
    restarting a trainer that would train on nothing again."""


def first_failure(infos: Iterable[dict]) -> str | None:
    """The first episode's error when every episode of `infos` (rows' reward_info) failed;
    None when one did not, or when the rows are not agent episodes (no `end_reason` of an
    agent)."""
    first, seen = None, False
    for info in infos:
        info = info or {}
        reason = info.get("end_reason")
        if reason not in FAILED_END_REASONS:
            return None
        seen = True
        if first is None:
            first = info.get("agent_error") or f"the episode ended in {reason}"
    return first if seen else None


def failed_step_error(reward_infos: Iterable[str | None]) -> str | None:
    """`first_failure` of a step batch's `reward_info` column (JSON text per row)."""
    return first_failure(json.loads(text) if text else {} for text in reward_infos)


def count_failed_step(in_a_row: int, error: str | None, limit: int) -> int:
    """Failed steps in a row after this step (`error`: its first agent error, None when an
    episode of it did not fail). Raises AgentsFailed when the count reaches `limit` (0 = never)."""
    if error is None:
        return 0
    in_a_row += 1
    if limit and in_a_row >= limit:
        raise AgentsFailed(
            f"every agent episode failed in {in_a_row} steps in a row ({SETTING}: {limit}); "
            f"nothing was trained. The step's first agent error: {error}"
        )
    return in_a_row


def all_failed(errors: list[str], n: int, what: str) -> None:
    """Raise AgentsFailed when all `n` > 0 episodes of `what` (e.g. 'the held-out eval')
    failed; `errors` are their errors in order."""
    if n and len(errors) == n:
        raise AgentsFailed(
            f"every agent episode of {what} failed ({n} of {n}); the run stops before spending "
            f"training on it ({SETTING} = 0 turns this off). First agent error: {errors[0]}"
        )
