"""Retention: which queue entries may be deleted, decided from where the consumers durably are.

Pure functions over listings, record headers and checkpoint states; queue/pruning.py does the
I/O. An entry of stage S at seq s may be deleted once all of these hold:

- every kept checkpoint is past it. A consumer's durable position is what its checkpoint
  records: the colocate controller's `queue_cursors[S]`, the async trainer's `ready_cursor`.
  The oldest kept checkpoint (`train.keep_checkpoints`) decides, not the newest: the older ones
  are kept as fallbacks, and a fallback whose unconsumed entries were deleted would skip them.
- in an async run the derived stages commit at their input's seq, so `ready` s trained means
  rollout, ref and fwd s were all transformed: the trainer's watermark covers every stage, and
  every stage is deleted through the same seq (`aligned`). Rollout workers need old entries only
  to tell which admitted blocks reached the stage, which the summaries answer.
- it was generated more than `keep_versions` policy versions before the newest checkpoint;
- it is not the newest entry of its stage: a writer without a hint numbers its next entry after
  the newest it lists, so deleting that one would hand its seq out a second time.

Deletion is a contiguous prefix per stage (pruned "through" a seq), so a summary object names a
range, `pruned/{stage}/{first:020d}-{last:020d}`, and "was s pruned" is a comparison.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from relax_core.queue.queue import STAGES, parse_seq, seq_name
from relax_core.queue.record import admitted_counts

PRUNED = "pruned"


def summary_name(first: int, last: int) -> str:
    return f"{seq_name(first)}-{seq_name(last)}"


def parse_summary_name(name: str) -> tuple[int, int] | None:
    """(first, last) of a summary object's name, None for anything else."""
    first, _, last = name.partition("-")
    a, b = parse_seq(first), parse_seq(last)
    return None if a is None or b is None or b < a else (a, b)


def covered(ranges: Iterable[tuple[int, int]], seq: int) -> bool:
    return any(first <= seq <= last for first, last in ranges)


def pruned_through(ranges: Iterable[tuple[int, int]]) -> int:
    """The highest seq a stage is pruned through (-1: nothing pruned)."""
    return max((last for _, last in ranges), default=-1)


def consumer_positions(states: Sequence[Mapping[str, Any]], mode: str) -> dict[str, int]:
    """stage -> the highest seq every kept checkpoint has consumed (all seqs <= it are done).

    `states`: the state.json of every kept checkpoint. Async: the trainer's ready watermark, for
    every stage (seqs are shared along the chain). Colocate: each stage's own cursor.
    """
    if not states:
        return dict.fromkeys(STAGES, -1)
    if mode == "async":
        through = min(int((s.get("ready_cursor") or {}).get("through", -1)) for s in states)
        return dict.fromkeys(STAGES, through)
    return {
        stage: min(int((s.get("queue_cursors") or {}).get(stage, -1)) for s in states)
        for stage in STAGES
    }


def entry_version(record: Mapping[str, Any] | None) -> int | None:
    """The newest policy version that generated any group of an entry (None: not known, e.g. a
    tombstone or an unreadable record, which never holds deletion back)."""
    if not record:
        return None
    versions = [int(v) for v in (record.get("versions") or {})]
    if versions:
        return max(versions)
    at = (record.get("meta") or {}).get("policy_version")
    return int(at) if at is not None else None


def candidates(listed: Sequence[int], done_through: int, position: int) -> list[int]:
    """Listed seqs above what is pruned that the consumers are past, the newest one excluded."""
    if not listed:
        return []
    top = min(position, max(listed) - 1)
    return [s for s in listed if done_through < s <= top]


def leftovers(listed: Sequence[int], done_through: int) -> list[int]:
    """Listed seqs a summary already covers: a pass that stopped before deleting them."""
    return [s for s in listed if s <= done_through]


def prune_bound(
    candidate_seqs: Sequence[int],
    versions: Mapping[int, int | None],
    max_version: int,
    done_through: int,
) -> int:
    """The seq to prune through: the end of the longest run of candidates, oldest first, that
    were generated at policy versions <= `max_version` (`done_through` if none was)."""
    bound = done_through
    for seq in sorted(candidate_seqs):
        version = versions.get(seq)
        if version is not None and version > max_version:
            break
        bound = seq
    return bound


def summarize(
    stage: str,
    first: int,
    last: int,
    headers: Mapping[int, dict[str, Any] | None],
    fallback: Mapping[int, dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The summary record of pruning `stage` through seqs first..last (`headers`: their records,
    None for an unreadable one).

    `versions` counts groups by behaviour version. A record without any (a tombstone) counts the
    groups of `fallback`'s record at the same seq (the rollout entry it stands for), which is
    what the async trainer counts as arrived. `blocks`: the admission blocks the rollout
    entries held (first ticket -> worker, dropped groups), which a restarted rollout worker needs
    to know were committed. `payloads`: the separate payload objects to delete.
    """
    out: dict[str, Any] = {"stage": stage, "first": first, "last": last, "entries": len(headers)}
    totals = dict.fromkeys(("rows", "groups", "bytes", "tombstones", "unreadable"), 0)
    versions: dict[str, int] = {}
    admitted: dict[str, int] = {}  # per admission version (record.admitted_counts)
    blocks: dict[str, dict[str, Any]] = {}
    payloads: list[str] = []
    for seq in sorted(headers):
        record = headers[seq]
        if record is None:
            totals["unreadable"] += 1
            continue
        totals["tombstones"] += 1 if record.get("tombstone") else 0
        for key in ("rows", "groups", "bytes"):
            totals[key] += int(record.get(key) or 0)
        counted = record.get("versions") or ((fallback or {}).get(seq) or {}).get("versions")
        for version, n in (counted or {}).items():
            versions[str(version)] = versions.get(str(version), 0) + int(n)
        for version, n in admitted_counts({**record, "versions": counted}).items():
            admitted[str(version)] = admitted.get(str(version), 0) + int(n)
        meta = record.get("meta") or {}
        if stage == "rollout" and meta.get("tickets"):
            block = {"worker": meta.get("worker", "")}
            if meta.get("dropped"):
                block["dropped"] = list(meta["dropped"])
            blocks[str(int(meta["tickets"][0]))] = block
        payload = record.get("payload")
        if isinstance(payload, str) and payload.startswith(f"data/{stage}/"):
            payloads.append(payload)
    out.update(totals, versions=versions, admitted=admitted, payloads=payloads)
    if blocks:
        out["blocks"] = blocks
    return out


def totals(summaries: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """Entries, groups and rows over a stage's summaries (what the audit and `relax queue` say)."""
    out = {"entries": 0, "groups": 0, "rows": 0, "through": -1}
    for s in summaries:
        for key in ("entries", "groups", "rows"):
            out[key] += int(s.get(key, 0))
        out["through"] = max(out["through"], int(s.get("last", -1)))
    return out
