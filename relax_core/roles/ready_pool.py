"""The async trainer's view of `ready`: untrained groups with their behaviour versions, and
which versions still have groups in flight (admitted but not yet in `ready`), so a step batch
takes the oldest groups and never one newer than a group still being generated."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from relax_core.queue import StageCursor, select_step_groups
from relax_core.queue.admission import VOID
from relax_core.queue.pruning import summaries
from relax_core.queue.record import admitted_counts
from relax_core.queue.retention import covered
from relax_core.roles.service import RoleContext

log = logging.getLogger(__name__)


class ReadyPool:
    """Untrained groups read from `ready`, and what is known about groups still in flight.

    In flight = admitted by the ledger but not yet in `ready`, by behaviour version. Ticket
    blocks and commit records never change once written, so each is read once.
    """

    def __init__(self, ctx: RoleContext, cursor: dict[str, Any]) -> None:
        self.ctx = ctx
        self.queue = ctx.queue
        self.cursor = StageCursor.from_dict(cursor)
        self.partial: dict[int, set[str]] = {
            int(k): set(v) for k, v in cursor.get("partial", {}).items()
        }
        self.tables: dict[int, pa.Table] = {}  # seq -> rows not trained yet
        self.groups: dict[str, tuple[int, int]] = {}  # group id -> (behaviour version, seq)
        self.meta: list[dict[str, Any]] = []  # metrics of entries read since the last step
        self._tickets: dict[str, dict[str, Any]] = {}
        self._voided: dict[str, dict[str, Any]] = {}
        self._arrived: Counter[int] = Counter()  # admission version -> groups seen in ready
        self._seen: set[int] = set()
        self._pruned: list[tuple[int, int]] | None = None  # ranges retention deleted
        self.quarantined = 0

    # ---- reading -----------------------------------------------------------------------
    def refresh(self) -> int:
        """Read every `ready` entry not seen yet; returns how many were new."""
        new = 0
        # The first listing covers the whole stage: entries trained before a resume still count
        # as arrived, or their versions would look in flight forever.
        if self._pruned is None:
            self._count_pruned()
        after = self.cursor.through if self._seen else -1
        for seq in self.queue.committed("ready", after):
            if seq in self._seen:
                continue
            self._seen.add(seq)
            if self.cursor.consumed(seq):
                if not covered(self._pruned or [], seq):  # else its summary counted it
                    self._count_arrived(seq, None)
                continue
            new += 1
            entry = self.queue.entry("ready", seq)
            self._count_arrived(seq, entry.record if entry.table is not None else None)
            if entry.table is None:
                log.warning("ready entry %d has no rows (%s)", seq, entry.skipped)
                self.quarantined += 1
                self.cursor.advance(seq)
                continue
            table = entry.table
            trained = self.partial.get(seq)
            if trained:
                keep = pc.invert(pc.is_in(table.column("group_id"), pa.array(sorted(trained))))
                table = table.filter(keep)
            self.tables[seq] = table
            versions = table.column("behaviour_version_min").to_pylist()
            for gid, version in zip(table.column("group_id").to_pylist(), versions, strict=True):
                old = self.groups.get(gid)
                self.groups[gid] = (min(version, old[0]) if old else version, seq)
            self.meta.append(entry.record.get("meta") or {})
        return new

    def _count_pruned(self) -> None:
        """Count the groups of the `ready` entries retention deleted (trained before the newest
        checkpoint) from their summaries. Read once, before this process prunes anything; the
        trainer is the only process that prunes an async run."""
        found = summaries(self.queue.store, "ready")
        self._pruned = [(int(s["first"]), int(s["last"])) for s in found]
        for summary in found:
            for version, count in (
                summary.get("admitted") or summary.get("versions") or {}
            ).items():
                self._arrived[int(version)] += int(count)

    def _count_arrived(self, seq: int, record: dict[str, Any] | None) -> None:
        """Count the groups of ready entry `seq` as no longer in flight. Without a usable
        record (a tombstone, an entry trained before a resume) they are looked up in the ready
        record, then in the rollout record of the same seq (the stages keep seqs)."""
        for stage in ("ready", "rollout"):
            if record is not None and record.get("versions"):
                break
            try:
                record = self.queue.record(stage, seq)
            except Exception:  # an unreadable record: its groups cannot be placed
                record = None
        for version, count in admitted_counts(record).items():
            self._arrived[int(version)] += int(count)

    def in_flight_versions(self) -> list[int]:
        """Admission versions that still have admitted groups not in `ready` (a group's rows may
        carry a newer behaviour version; selection compares the two conservatively)."""
        store = self.queue.store
        for name in store.list_dir("tickets"):
            if name not in self._tickets and name.isdigit():
                self._tickets[name] = json.loads(store.read_bytes(f"tickets/{name}"))
        for name in store.list_dir(VOID):
            if name not in self._voided and name.isdigit():
                self._voided[name] = json.loads(store.read_bytes(f"{VOID}/{name}"))
        admitted: Counter[int] = Counter()
        for body in self._tickets.values():
            admitted[int(body["policy_version"])] += int(body["count"])
        for body in self._voided.values():  # their worker died; new blocks hold their prompts
            admitted[int(body["policy_version"])] -= int(body["count"])
        return [v for v, n in admitted.items() if n > self._arrived.get(v, 0)]

    # ---- taking a step batch -----------------------------------------------------------
    def select(self, groups_per_step: int, ignore_in_flight: bool) -> list[str] | None:
        available = [(gid, version) for gid, (version, _) in self.groups.items()]
        in_flight = [] if ignore_in_flight else self.in_flight_versions()
        return select_step_groups(available, in_flight, groups_per_step)

    def take(self, group_ids: list[str]) -> pa.Table:
        """Remove `group_ids` from the pool and return their rows (entries fully trained
        advance the cursor; partly trained ones are remembered in `partial`)."""
        by_seq: dict[int, set[str]] = {}
        for gid in group_ids:
            _, seq = self.groups.pop(gid)
            by_seq.setdefault(seq, set()).add(gid)
        parts = []
        for seq, gids in sorted(by_seq.items()):
            table = self.tables[seq]
            chosen = pc.is_in(table.column("group_id"), pa.array(sorted(gids)))
            parts.append(table.filter(chosen))
            rest = table.filter(pc.invert(chosen))
            if rest.num_rows:
                self.tables[seq] = rest
                self.partial.setdefault(seq, set()).update(gids)
            else:
                del self.tables[seq]
                self.partial.pop(seq, None)
                self.cursor.advance(seq)
        return pa.concat_tables(parts)

    def state(self) -> dict[str, Any]:
        return {
            **self.cursor.to_dict(),
            "partial": {str(k): sorted(v) for k, v in self.partial.items()},
        }

    def pop_meta(self) -> list[dict[str, Any]]:
        meta, self.meta = self.meta, []
        return meta
