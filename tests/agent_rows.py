"""Reading an agent row as the engine calls it holds (tests of the OpenAI-compatible endpoint)."""

from __future__ import annotations

import pytest


def sampled_runs(row: dict) -> list[tuple[list[int], list[int], slice]]:
    """(context, sampled ids, their slice of the response) of each run of loss_mask-1 tokens of
    a row: the context is the prompt and the response before the run."""
    seq, mask, out, at = row["prompt_ids"] + row["response_ids"], row["loss_mask"], [], 0
    n = len(row["prompt_ids"])
    while at < len(mask):
        if not mask[at]:
            at += 1
            continue
        end = at
        while end < len(mask) and mask[end]:
            end += 1
        out.append((seq[: n + at], row["response_ids"][at:end], slice(at, end)))
        at = end
    return out


def assert_rows_hold_engine_calls(rows: list[dict], calls: list[tuple]) -> None:
    """Each run of loss_mask-1 tokens of each row is one engine call of `calls` ((prompt ids,
    sampled ids, log-probs) as the engine saw and sampled them): its sampled ids, with their
    log-probs, after exactly that call's prompt; and every call is in some row."""
    left = list(calls)
    for row in rows:
        for context, sampled, span in sampled_runs(row):
            call = next((c for c in left if c[0] == context and c[1] == sampled), None)
            assert call is not None, f"row {row['uid']}: a sampled run no engine call made"
            assert row["rollout_logprobs"][span] == pytest.approx(call[2])
            left.remove(call)
    assert left == [], f"{len(left)} engine calls are in no row"
