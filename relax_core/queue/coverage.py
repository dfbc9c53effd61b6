"""Prompt coverage of a finished async run: was every prompt of the dataset stream, up to the
run's end, trained exactly once in its epoch, or is it still queued?

Unlike `audit_run` (audit.py), which starts from the groups rollout committed and reads the
trainer's replaceable `control/trained` records and its checkpoint's cursor, this starts from the
dataset and reads neither:
- the stream: the admission tickets (`tickets/`: each block issues stream positions
  `stream_first`.., by default its own tickets; a block voided by its worker's restart issues
  nothing, the block that redoes it issues its positions again) and the dataset's order, which
  the caller passes in (position p is prompt `order(p // size)[p % size]` of epoch p // size);
- what is still queued: the rows of the `rollout` and `ready` stages (their `epoch` and
  `prompt_index` columns) that no surviving step trained, and the blocks admitted but neither
  committed nor voided when the run ended (being generated when it stopped);
- what was trained: the step log `control/steps/` (`record_step`), one write-once record per
  step per trainer process, so a step trained again after a restart leaves both records. The
  weights that survive are chosen here, not by replacement: the process that trained the final
  step, back to the step it resumed after, then the process that trained that step last before.

The trainer is the only witness of what it trained; the log is its history, which a restarted
process cannot rewrite, and every prompt it names is checked against the stream.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from relax_core.queue.admission import DROPPED, VOID
from relax_core.queue.pruning import summaries
from relax_core.queue.queue import TransferQueue, parse_seq
from relax_core.queue.record import CorruptEntry

STEPS = "control/steps"

Prompt = tuple[int, int]
"""(epoch, prompt_index): one prompt of the stream, trained at most once per epoch."""

# roles/rollout.group_columns names a group after its prompt. Only read for groups whose rows
# retention deleted; the rows' own columns are used wherever they exist.
_GROUP_ID = re.compile(r"^e(\d+)-p(\d+)$")


def record_step(queue: TransferQueue, version: int, group_ids: Iterable[str]) -> None:
    """Append what step `version` trained to the step log, once per trainer process (the
    queue's writer id): never replaced, so every process's history of a step stays readable."""
    body = {
        "version": version,
        "writer": queue.writer_id,
        "time": time.time(),
        "groups": sorted(map(str, group_ids)),
    }
    queue.store.create_if_absent(
        f"{STEPS}/{version:020d}-{queue.writer_id}", json.dumps(body).encode()
    )


def surviving_steps(records: Sequence[Mapping[str, Any]]) -> tuple[dict[int, Mapping], list[int]]:
    """(version -> the record of the step whose weights survive, versions with none).

    The final version's newest record belongs to the process that finished the run. A process
    resumed after the checkpoint of the step before its first one; that step, and those before
    it, are the ones of the process that trained it last before this one started.
    """
    if not records:
        return {}, []
    by_writer: dict[str, dict[int, Mapping]] = {}
    for record in records:
        by_writer.setdefault(str(record["writer"]), {})[int(record["version"])] = record
    started = {w: min(float(r["time"]) for r in steps.values()) for w, steps in by_writer.items()}
    final = max(int(r["version"]) for r in records)
    writer = str(max((r for r in records if int(r["version"]) == final), key=_time)["writer"])
    chain: dict[int, Mapping] = {}
    missing: list[int] = []
    for version in range(final, 0, -1):
        if version not in by_writer[writer]:
            earlier = [
                steps[version]
                for steps in by_writer.values()
                if version in steps and _time(steps[version]) < started[writer]
            ]
            if not earlier:
                missing.append(version)
                continue
            writer = str(max(earlier, key=_time)["writer"])
        chain[version] = by_writer[writer][version]
    return chain, sorted(missing)


def _time(record: Mapping[str, Any]) -> float:
    return float(record["time"])


def issued_positions(blocks: Mapping[int, Mapping], voided: Mapping[int, Mapping]) -> Counter[int]:
    """How often each stream position was issued by an admitted block that was not voided.
    `blocks`/`voided`: first ticket -> `tickets/` / `tickets-void/` record. A record of groups
    dropped by dynamic sampling is not a void: those prompts were generated."""
    issued: Counter[int] = Counter()
    for first, body in blocks.items():
        void = voided.get(first)
        if void is not None and void.get("reason") != DROPPED:
            continue
        start = int(body.get("stream_first", first))
        issued.update(range(start, start + int(body["count"])))
    return issued


def stream_prompts(end: int, num_prompts: int, order: Callable[[int], Sequence[int]]) -> list:
    """The prompts at stream positions 0..end-1: position p is `order(e)[p % num_prompts]` of
    epoch e = p // num_prompts (data/prompts.PromptSource.at)."""
    return [(p // num_prompts, int(order(p // num_prompts)[p % num_prompts])) for p in range(end)]


def prompt_coverage(
    stream: Sequence[Prompt],
    trained: Counter[Prompt],
    queued: Iterable[Prompt],
    dropped: Iterable[Prompt] = (),
) -> dict[str, int]:
    """Counts over the prompts of `stream` (stream positions 0..end-1, in order): trained once,
    still queued (untrained, generated or being generated), dropped (dynamic sampling consumes
    them), missing (none of these), trained twice; and out of stream: a prompt trained or
    queued that the stream never issued up to its end."""
    in_stream = set(stream)
    queued, dropped = set(queued), set(dropped)
    counts = dict.fromkeys(
        ("trained_once", "still_queued", "dropped", "missing", "trained_twice"), 0
    )
    for prompt in in_stream:
        n = trained[prompt]
        if n > 1:
            counts["trained_twice"] += 1
        elif n == 1:
            counts["trained_once"] += 1
        elif prompt in queued:
            counts["still_queued"] += 1
        elif prompt in dropped:
            counts["dropped"] += 1
        else:
            counts["missing"] += 1
    outside = (set(trained) | queued) - in_stream
    return {"stream_prompts": len(stream), **counts, "out_of_stream": len(outside)}


def coverage_errors(counts: Mapping[str, int]) -> int:
    """Prompts missing, trained twice or out of stream (the bench's headline)."""
    return counts["missing"] + counts["trained_twice"] + counts["out_of_stream"]


def read_prompt_coverage(
    queue: TransferQueue, num_prompts: int, order: Callable[[int], Sequence[int]]
) -> dict[str, int]:
    """`prompt_coverage` of the run in `queue`, for a train dataset of `num_prompts` prompts
    whose epoch e is handed out in the order `order(e)` (data.PromptSampler(...).order), plus
    the stream positions never issued or issued twice and the steps without a record."""
    blocks = _json_dir(queue, "tickets")
    voided = _json_dir(queue, VOID)
    issued = issued_positions(blocks, voided)
    end = max(issued, default=-1) + 1
    stream = stream_prompts(end, num_prompts, order)

    rows: dict[str, Prompt] = {}  # group id -> its prompt, from the rows still in the queue
    committed: set[int] = set()  # first tickets of the blocks that reached `rollout`
    for stage in ("rollout", "ready"):
        for seq in queue.committed(stage):
            try:  # read, never quarantined here: an audit changes nothing
                record = queue.record(stage, seq)
                tickets = (record.get("meta") or {}).get("tickets")
                if stage == "rollout" and tickets:
                    committed.add(int(tickets[0]))
                table = queue.read(stage, seq) if record["payload"] is not None else None
            except (CorruptEntry, FileNotFoundError):  # unusable, or deleted by retention
                continue
            if table is None:
                continue
            cols = table.select(["group_id", "epoch", "prompt_index"]).to_pydict()
            for gid, epoch, index in zip(*cols.values(), strict=True):
                rows[gid] = (int(epoch), int(index))
    for summary in summaries(queue.store, "rollout"):
        committed.update(int(first) for first in summary.get("blocks") or {})

    chain, missing_steps = surviving_steps(_step_records(queue))
    trained: Counter[Prompt] = Counter()
    unknown = 0  # a trained group id with neither rows nor a prompt in its name
    for record in chain.values():
        for group in record["groups"]:
            prompt = rows.get(group) or _prompt_of(group)
            if prompt is None:
                unknown += 1
            else:
                trained[prompt] += 1
    trained_groups = {g for record in chain.values() for g in record["groups"]}
    queued = {p for g, p in rows.items() if g not in trained_groups}
    for first, body in blocks.items():  # being generated when the run ended
        if first not in committed and first not in voided:
            start = int(body.get("stream_first", first))
            queued.update(stream[start : start + int(body["count"])])
    dropped = {
        _prompt_of(g)
        for body in voided.values()
        if body.get("reason") == DROPPED
        for g in body.get("groups", [])
    }
    counts = prompt_coverage(stream, trained, queued, dropped - {None})
    counts["out_of_stream"] += unknown
    counts["never_issued"] = sum(1 for p in range(end) if issued[p] == 0)
    counts["issued_twice"] = sum(1 for n in issued.values() if n > 1)
    counts["trained_steps"] = len(chain)
    counts["missing_steps"] = len(missing_steps)
    return counts


def _prompt_of(group_id: str) -> Prompt | None:
    found = _GROUP_ID.match(group_id)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _json_dir(queue: TransferQueue, prefix: str) -> dict[int, dict]:
    """seq -> record of the JSON records named by a seq under `prefix` (tickets, voids)."""
    store = queue.store
    names = [n for n in store.list_dir(prefix) if parse_seq(n) is not None]
    return {int(n): json.loads(store.read_bytes(f"{prefix}/{n}")) for n in names}


def _step_records(queue: TransferQueue) -> list[dict]:
    store = queue.store
    return [json.loads(store.read_bytes(f"{STEPS}/{n}")) for n in store.list_dir(STEPS)]
