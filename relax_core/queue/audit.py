"""Exactly-once audit of a finished async run: was every generated group trained once, or is it
still in the queue, and was none lost or trained twice, across crashes and restarts?

Sources: the rollout stage (every group a rollout process committed), the trainer's
`control/trained/{version}` records (what each step of the surviving weights trained; a step a
restarted trainer trained again replaced its record), the final checkpoint's ready cursor
(what is still waiting in the queue when the run ended) and the summaries of what retention
deleted (`pruned/rollout/`). Retention deletes only entries every kept checkpoint had trained,
so the pruned groups are accounted for by count: the trained groups the kept rollout stage does
not hold must be exactly as many as the pruned ones; more is a group trained that never was
generated, fewer a pruned group that was never trained (lost).
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

from relax_core.queue import StageCursor, TransferQueue
from relax_core.queue.coverage import record_step
from relax_core.queue.pruning import pruned_ranges, summaries
from relax_core.queue.retention import covered, totals

TRAINED = "control/trained"


def record_trained(queue: TransferQueue, version: int, group_ids: list) -> None:
    """The groups step `version` trained (the trainer writes it), replaced if a restarted trainer
    trains that step again: the records of the weights that survive, which the audit reads. Also
    appended to the step log (coverage.record_step), which nothing replaces."""
    body = json.dumps({"version": version, "groups": sorted(map(str, group_ids))})
    queue.store.write_replace(f"{TRAINED}/{version:020d}", body.encode())
    record_step(queue, version, group_ids)  # the write-once history prompt coverage reads


def trained_groups(queue: TransferQueue, final_version: int) -> Counter[str]:
    """How often each group was trained by steps 1..final_version."""
    counts: Counter[str] = Counter()
    for name in queue.store.list_dir(TRAINED):
        if name.isdigit() and int(name) <= final_version:
            counts.update(json.loads(queue.store.read_bytes(f"{TRAINED}/{name}"))["groups"])
    return counts


def audit_run(queue: TransferQueue, final_state: dict[str, Any]) -> dict[str, int]:
    """Counts of groups generated, trained, still queued, lost and duplicated, and of the
    entries and groups retention deleted (counted as generated, trained once)."""
    final_version = int(final_state["policy_version"])
    cursor_data = final_state.get("ready_cursor") or {"through": -1}
    cursor = StageCursor.from_dict(cursor_data)
    partial = {int(k): set(v) for k, v in (cursor_data.get("partial") or {}).items()}
    pruned = totals(summaries(queue.store, "rollout"))
    ranges = pruned_ranges(queue.store, "rollout")
    generated: Counter[str] = Counter()
    by_seq: dict[int, set[str]] = {}
    for seq in queue.committed("rollout"):
        if covered(ranges, seq):  # left by a pruning pass cut short: counted as pruned
            continue
        groups = set(queue.read("rollout", seq).column("group_id").to_pylist())
        by_seq[seq] = groups
        generated.update(groups)
    trained = trained_groups(queue, final_version)
    ready = set(queue.committed("ready"))
    queued: set[str] = set()
    for seq, groups in by_seq.items():
        if seq not in ready:  # still between stages when the run ended
            queued |= groups
        elif not cursor.consumed(seq):
            queued |= groups - partial.get(seq, set())
    lost = [g for g in generated if g not in trained and g not in queued]
    trained_elsewhere = len(set(trained) - set(generated))  # generated in pruned entries?
    return {
        "generated_groups": len(generated) + pruned["groups"],
        "trained_groups": len(trained),
        "queued_groups": len(queued - set(trained)),
        "lost_groups": len(lost) + max(0, pruned["groups"] - trained_elsewhere),
        "duplicated_groups": sum(n - 1 for n in trained.values() if n > 1)
        + sum(n - 1 for n in generated.values() if n > 1),
        "trained_but_never_generated": max(0, trained_elsewhere - pruned["groups"]),
        "pruned_entries": pruned["entries"],
        "pruned_groups": pruned["groups"],
    }
