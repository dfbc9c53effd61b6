"""Reading an agent row as the engine calls it holds (tests of the OpenAI-compatible endpoint)."""

from __future__ import annotations


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
