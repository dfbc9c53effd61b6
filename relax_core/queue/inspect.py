"""What a person watching a run wants to know about its queue, gathered from the storage alone.

`summarize` reads commit records (never payloads), claims, tickets, heartbeats, quarantine notes
and the summaries of what retention deleted, of one run prefix, and returns plain data; `render`
turns it into the text the CLI prints.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from relax_core.queue.admission import AdmissionLedger
from relax_core.queue.claims import latest_claims
from relax_core.queue.pruning import read_headers, summaries
from relax_core.queue.queue import STAGES, TransferQueue, parse_seq
from relax_core.queue.retention import totals
from relax_core.queue.store import ObjectStore

# Which stage consumes which (a stage a run does not use simply has no entries).
_CONSUMERS = {"rollout": ("ref", "fwd", "ready"), "ref": ("fwd", "ready"), "fwd": ("ready",)}


def list_runs(root: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Run ids with a queue under `root` (folders that hold a log/)."""
    store = ObjectStore(root, storage_options)
    return [name for name in store.list_dir("") if store.list_dir(f"{name}/log")]


def _stage_summary(queue: TransferQueue, stage: str) -> dict[str, Any]:
    seqs = queue.committed(stage)
    headers = read_headers(queue.store, stage, seqs)  # an entry deleted since the listing: none
    seqs = [s for s in seqs if s in headers]
    records = {s: h if h is not None else {"corrupt": True} for s, h in headers.items()}
    versions: Counter[int] = Counter()
    lag: Counter[int] = Counter()
    groups = rows = tombstones = 0
    for record in records.values():
        if record.get("tombstone"):
            tombstones += 1
            continue
        groups += int(record.get("groups", 0))
        rows += int(record.get("rows", 0))
        at = (record.get("meta") or {}).get("policy_version")
        for version, count in (record.get("versions") or {}).items():
            versions[int(version)] += count
            if at is not None:
                lag[int(at) - int(version)] += count
    return {
        "entries": len(seqs),
        "last_seq": seqs[-1] if seqs else None,
        "groups": groups,
        "rows": rows,
        "tombstones": tombstones,
        "seqs": seqs,
        "groups_by_version": dict(sorted(versions.items())),
        "lag_at_commit": dict(sorted(lag.items())),
        "quarantined": queue.quarantined(stage),
        "pruned": totals(summaries(queue.store, stage)),
    }


def summarize(queue: TransferQueue) -> dict[str, Any]:
    """Stages (entries, groups, backlog), claims, admission tickets, heartbeats, quarantine."""
    stages = {stage: _stage_summary(queue, stage) for stage in STAGES}
    for stage, info in stages.items():
        downstream = next((d for d in _CONSUMERS.get(stage, ()) if stages[d]["entries"]), None)
        done = set(stages[downstream]["seqs"]) if downstream else set()
        info["consumed_by"] = downstream
        info["pending"] = len([s for s in info["seqs"] if s not in done]) if downstream else None
    claims = {}
    for stage in STAGES:
        latest = latest_claims(queue, stage)
        if latest:
            claims[stage] = {
                "entries": len(latest),
                "taken_over": sum(1 for a in latest.values() if a > 0),
            }
    now = time.time()
    beats = [
        {
            "who": f"{b.get('role')}-{b.get('worker_id')}",
            "age_s": round(now - float(b.get("time", now)), 1),
            "info": b.get("info", {}),
        }
        for b in queue.heartbeats()
    ]
    versions = [
        b["info"]["policy_version"]
        for b in beats
        if isinstance(b["info"], dict) and isinstance(b["info"].get("policy_version"), int)
    ]
    ledger = AdmissionLedger(queue)
    return {
        "run_id": queue.run_id,
        "url": queue.store.url(""),
        "stages": stages,
        "claims": claims,
        "admitted": ledger.started(),
        "admitted_by_version": ledger.started_by_version(),
        "policy_version": max(versions) if versions else None,
        "heartbeats": beats,
        "stopped": queue.stopped(),
        "foreign": foreign_log_names(queue),
    }


_NEWEST = 12


def _hist(counts: dict[int, int], width: int = 30) -> list[str]:
    """One bar per key; with many keys (a long run's versions) only the newest few, and a line
    saying how many older ones there are."""
    if not counts:
        return ["    (none)"]
    top = max(counts.values())
    keys = sorted(counts)
    lines = []
    if len(keys) > _NEWEST:
        older = keys[:-_NEWEST]
        lines.append(
            f"    ({len(older)} older: {older[0]}..{older[-1]}, {sum(counts[k] for k in older)} "
            "groups)"
        )
        keys = keys[-_NEWEST:]
    return lines + [
        f"    {key:>4}  {'#' * max(1, round(width * counts[key] / top)):<{width}} {counts[key]}"
        for key in keys
    ]


def render(summary: dict[str, Any]) -> str:
    """The summary as a few tables a person reads at a glance."""
    lines = [f"run {summary['run_id']}  ({summary['url']})"]
    state = "stopped" if summary["stopped"] else "running (no control/stop)"
    version = summary["policy_version"]
    lines.append(f"state: {state}; policy version from heartbeats: {version}")
    lines.append("")
    lines.append(
        f"{'stage':<8} {'entries':>8} {'groups':>8} {'rows':>9} {'pending':>8} "
        f"{'next stage':<10} {'tombst.':>7} {'quarant.':>8}"
    )
    for stage, s in summary["stages"].items():
        pending = "-" if s["pending"] is None else str(s["pending"])
        lines.append(
            f"{stage:<8} {s['entries']:>8} {s['groups']:>8} {s['rows']:>9} {pending:>8} "
            f"{s['consumed_by'] or '-':<10} {s['tombstones']:>7} {len(s['quarantined']):>8}"
        )
    pruned = [(st, s["pruned"]) for st, s in summary["stages"].items() if s["pruned"]["entries"]]
    if pruned:
        lines.append(
            "deleted by retention (queue.retention): "
            + ", ".join(
                f"{st} {p['entries']} entries, {p['groups']} groups (seqs <= {p['through']})"
                for st, p in pruned
            )
        )
    if summary["claims"]:
        lines.append("")
        lines.append(
            "leases: "
            + ", ".join(
                f"{stage} {c['entries']} claimed ({c['taken_over']} taken over)"
                for stage, c in summary["claims"].items()
            )
        )
    if summary["admitted"]:
        admitted = summary["admitted_by_version"]
        shown = list(admitted.items())[-_NEWEST:]
        by_version = ", ".join(f"v{v}: {n}" for v, n in shown)
        if len(admitted) > len(shown):
            by_version = f"... {len(admitted) - len(shown)} older versions, " + by_version
        lines.append(f"admitted groups: {summary['admitted']} ({by_version})")
    final = next((s for s in reversed(STAGES) if summary["stages"][s]["entries"]), None)
    if final:
        info = summary["stages"][final]
        lines.append("")
        lines.append(f"'{final}' groups by the policy version that generated them:")
        lines.extend(_hist(info["groups_by_version"]))
        if info["lag_at_commit"]:
            lines.append(
                f"staleness of '{final}' groups when committed (writer's policy version minus "
                "generating version):"
            )
            lines.extend(_hist(info["lag_at_commit"]))
    for stage, names in summary["foreign"].items():
        lines.append(f"foreign objects in log/{stage}/ (ignored): {', '.join(names[:5])}")
    notes = [n for s in summary["stages"].values() for n in s["quarantined"]]
    if notes:
        lines.append("")
        lines.append("quarantine:")
        lines.extend(f"  {n['stage']} {n['seq']}: {n['reason']}" for n in notes)
    if summary["heartbeats"]:
        lines.append("")
        lines.append("heartbeats:")
        lines.extend(
            f"  {b['who']:<24} {b['age_s']:>7}s ago  {b['info']}" for b in summary["heartbeats"]
        )
    return "\n".join(lines)


def foreign_log_names(queue: TransferQueue) -> dict[str, list[str]]:
    """Objects in log/{stage}/ that are not commit records (named by a seq)."""
    out = {}
    for stage in STAGES:
        bad = [n for n in queue.store.list_dir(f"log/{stage}") if parse_seq(n) is None]
        if bad:
            out[stage] = bad
    return out
