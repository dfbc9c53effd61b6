"""TransferQueue: the append-only, multi-writer data bus between roles, on one storage prefix.

Layout under `{root}/{run_id}/` (docs/queue.md has every prefix):
  log/{stage}/{seq:020d}      commit record, created only if absent: a JSON header line, then
                              the payload itself (whole groups, Arrow IPC, zstd) when it is at
                              most inline_max_bytes (record.py)
  data/{stage}/{uuid}.arrow   a larger payload, immutable, named by its record
  claims/{stage}/...          consumer leases (claims.py)
  quarantine/{stage}/{seq:020d}.json (+ .arrow)   a corrupt entry, moved aside with its reason
  control/stop, control/heartbeats/{role}-{id}, control/probe/

Two ways to commit, both a single create-if-absent, so readers never see a partial write:
- `put` appends at the next free seq (producers: any number of rollout workers). The loser of a
  race for a seq moves on to a later one.
- `commit` writes at a given seq (a stage derived 1:1 from an input entry keeps the input's seq),
  so when two workers process the same input (a lease taken over) exactly one output lands.
A corrupt or foreign entry is moved to quarantine/ and skipped with a logged reason; the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from relax_core.queue.ipc import decode_table, encode_table
from relax_core.queue.record import (
    INLINE,
    CorruptEntry,
    decode_record,
    encode_record,
    version_counts,
)
from relax_core.queue.schema import validate_table
from relax_core.queue.store import ObjectStore, RetryPolicy, probe_create_if_absent

log = logging.getLogger(__name__)

STAGES = ("rollout", "ref", "fwd", "ready")
_SEQ_WIDTH = 20


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown queue stage {stage!r}; stages are {list(STAGES)}")


def _check_name_part(kind: str, value: str) -> None:
    if not value or "/" in value:
        raise ValueError(f"{kind} must be a non-empty name without '/', got {value!r}")


def seq_name(seq: int) -> str:
    return f"{seq:0{_SEQ_WIDTH}d}"


def log_path(stage: str, seq: int) -> str:
    return f"log/{stage}/{seq_name(seq)}"


def parse_seq(name: str) -> int | None:
    if len(name) == _SEQ_WIDTH and name.isdigit():
        return int(name)
    return None


@dataclass(frozen=True)
class Entry:
    """One committed entry as a consumer sees it: a table, or the reason it has none."""

    stage: str
    seq: int
    record: dict[str, Any]
    table: pa.Table | None
    skipped: str = ""
    """Why there is no table: the entry was quarantined, or it is an upstream tombstone."""


class TransferQueue:
    """One run's queue: `put`/`commit` write entries of a stage, `entry`/`next` read them by seq."""

    def __init__(
        self,
        root: str,
        run_id: str,
        storage_options: dict[str, Any] | None = None,
        *,
        durable: bool = True,
        multi_writer: bool = True,
        retry: RetryPolicy | None = None,
        inline_max_bytes: int = 4 << 20,
    ) -> None:
        """Open the queue of `run_id` under `root` (storage is probed before the first write).

        `durable=False` skips fsync on local disk (see ObjectStore). `multi_writer=False` lets a
        single writer run on storage that does not enforce conditional creates. Payloads up to
        `inline_max_bytes` travel inside their commit record (record.py).
        """
        _check_name_part("run_id", run_id)
        self.run_id = run_id
        root_url = f"{str(root).rstrip('/')}/{run_id}"
        self.store = ObjectStore(root_url, storage_options, durable=durable, retry=retry)
        self.writer_id = uuid.uuid4().hex[:12]
        self.multi_writer = multi_writer
        self.inline_max_bytes = inline_max_bytes
        # Next seq to try per stage. Only a hint: create_if_absent decides who owns a seq.
        self._next_seq: dict[str, int] = {}
        self._create_checked = self.store.is_local

    def probe(self) -> bool:
        """Check access and whether the storage enforces create-if-absent (start-up probe).

        Raises a StorageError naming the prefix when storage is unreachable or access is denied,
        and a RuntimeError in multi-writer mode when conditional creates are not enforced.
        """
        self.store.check_access()
        enforced = self.store.is_local or probe_create_if_absent(
            self.store, f"control/probe/{self.writer_id}-{uuid.uuid4().hex}"
        )
        if not enforced:
            if self.multi_writer:
                raise RuntimeError(
                    f"storage at {self.store.url('')} does not enforce create-if-absent "
                    "(If-None-Match: *), so concurrent writers could overwrite each other's "
                    "commits; use storage that supports conditional writes, or run a single "
                    "writer per stage (multi_writer=False)"
                )
            log.warning(
                "storage at %s ignores create-if-absent; single-writer mode only",
                self.store.url(""),
            )
        self._create_checked = True
        return enforced

    # ---- writing ----------------------------------------------------------------------------

    def _prepare(self, stage: str, table: pa.Table, meta: dict | None) -> tuple[bytes, str]:
        """Validate, place the payload (inline or its own object): (record bytes, payload)."""
        _check_stage(stage)
        table = validate_table(table)
        try:
            meta_json = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as err:
            raise ValueError(f"meta must be JSON-serializable: {err}") from err
        if not self._create_checked:
            self.probe()
        data = encode_table(table, compress=not self.store.is_local)
        inline = len(data) <= self.inline_max_bytes
        payload = INLINE if inline else f"data/{stage}/{uuid.uuid4().hex}.arrow"
        if not inline:
            self.store.write_immutable(payload, data)
        versions = version_counts(table)
        record = {
            "payload": payload,
            "bytes": len(data),
            "rows": table.num_rows,
            "groups": sum(versions.values()),
            "versions": versions,
            "created": time.time(),
            "writer": self.writer_id,
            "nonce": uuid.uuid4().hex,  # makes every record's bytes unique (see create_if_absent)
            "meta": meta_json,
        }
        return encode_record(record, data if inline else None), payload

    def put(self, stage: str, table: pa.Table, meta: dict[str, Any] | None = None) -> int:
        """Append `table` (ROW_SCHEMA rows, whole groups) to `stage`; returns its seq."""
        data, _ = self._prepare(stage, table, meta)
        seq = self._next_seq.get(stage)
        if seq is None:
            seq = self._tail(stage)
        while not self.store.create_if_absent(log_path(stage, seq), data):
            # Lost the race: skip past everything committed meanwhile, not one seq at a time.
            seq = max(seq + 1, self._tail(stage))
        self._next_seq[stage] = seq + 1
        return seq

    def commit(
        self, stage: str, seq: int, table: pa.Table, meta: dict[str, Any] | None = None
    ) -> bool:
        """Commit `table` at exactly `seq` of `stage`; False if another writer got there first.

        The output of a 1:1 transform keeps its input's seq, so a retried or taken-over input
        yields one output however many workers processed it. A loser deletes its separate
        payload object (large entries), which no record names.
        """
        data, payload = self._prepare(stage, table, meta)
        won = self.store.create_if_absent(log_path(stage, seq), data)
        if not won and payload != INLINE:
            self.store.delete(payload)
        return won

    def commit_tombstone(self, stage: str, seq: int, reason: str) -> bool:
        """Fill `seq` of `stage` with a record that carries no rows, only `reason`.

        Used when an input entry was quarantined, so the derived stage stays gap-free and its
        readers see why that seq is empty instead of waiting for it.
        """
        _check_stage(stage)
        record = {"payload": None, "rows": 0, "groups": 0, "versions": {}, "tombstone": reason}
        record.update(created=time.time(), writer=self.writer_id)
        return self.store.create_if_absent(log_path(stage, seq), encode_record(record))

    # ---- reading ----------------------------------------------------------------------------

    def record(self, stage: str, seq: int) -> dict[str, Any]:
        """The commit record at `seq`: payload, rows, groups, versions, created, writer, meta."""
        return self._read_record(stage, seq)[0]

    def _read_record(self, stage: str, seq: int) -> tuple[dict[str, Any], bytes | None]:
        _check_stage(stage)
        path = log_path(stage, seq)
        return decode_record(self.store.read_bytes(path), self.store.url(path))

    def read(self, stage: str, seq: int) -> pa.Table:
        """The table committed at `seq` of `stage`; CorruptEntry naming the object if unusable."""
        return self._load(stage, seq, *self._read_record(stage, seq))

    def _load(self, stage: str, seq: int, record: dict[str, Any], inline: bytes | None) -> pa.Table:
        payload = record["payload"]
        if payload is None:
            raise CorruptEntry(
                f"{stage} entry {seq} has no rows: {record.get('tombstone', 'tombstone')}"
            )
        if inline is not None:
            url, data = self.store.url(log_path(stage, seq)), inline
        else:
            url = self.store.url(payload)
            try:
                data = self.store.read_bytes(payload)
            except FileNotFoundError as err:
                if not self.store.exists(log_path(stage, seq)):  # deleted by retention meanwhile
                    raise FileNotFoundError(f"{stage} entry {seq} was pruned") from err
                raise CorruptEntry(
                    f"queue payload {url} named by {stage} entry {seq} is missing"
                ) from err
        try:
            table = decode_table(data, url)
        except ValueError as err:
            raise CorruptEntry(str(err)) from err
        try:
            table = validate_table(table, check_domains=False)
        except ValueError as err:
            raise CorruptEntry(f"queue payload {url}: {err}") from err
        if table.num_rows != record["rows"]:
            raise CorruptEntry(
                f"queue payload {url} has {table.num_rows} rows but its commit record "
                f"{self.store.url(log_path(stage, seq))} says {record['rows']}"
            )
        return table

    def entry(self, stage: str, seq: int) -> Entry:
        """The entry at `seq`; a corrupt one is quarantined and returned without a table.

        FileNotFoundError if nothing is committed at `seq`.
        """
        try:
            record, inline = self._read_record(stage, seq)
            if record["payload"] is None:
                return Entry(stage, seq, record, None, f"tombstone: {record['tombstone']}")
            return Entry(stage, seq, record, self._load(stage, seq, record, inline))
        except CorruptEntry as err:
            # A quarantined entry's payload is gone, so its first reason is the one to report.
            reason = self.quarantine_reason(stage, seq) or self.quarantine(stage, seq, str(err))
            return Entry(stage, seq, {}, None, f"quarantined: {reason}")

    def committed(self, stage: str, after: int = -1) -> list[int]:
        """Sorted seqs of `stage` greater than `after`."""
        _check_stage(stage)
        seqs = (parse_seq(n) for n in self.store.list_dir(f"log/{stage}"))
        return sorted(s for s in seqs if s is not None and s > after)

    def next(self, stage: str, cursor: int) -> tuple[int, pa.Table] | None:
        """The first usable (seq, table) after `cursor`, or None if there is none yet.

        Quarantined entries and tombstones are passed over (they are logged and counted where
        they were found); the caller's cursor moves to the returned seq.
        """
        _check_stage(stage)
        # Seqs are dense in practice, so reading cursor + 1 first avoids listing the whole log.
        candidates, missing = [cursor + 1], set()
        while candidates:
            seq = candidates.pop(0)
            try:
                found = self.entry(stage, seq)
            except FileNotFoundError:
                if seq in missing:  # listed but not readable yet: try again on the next call
                    return None
                missing.add(seq)
                # seq - 1, not seq: an entry committed at seq since the read must not be missed.
                candidates = self.committed(stage, seq - 1)
                continue
            if found.table is not None:
                return seq, found.table
            log.warning("queue %s entry %d skipped (%s)", stage, seq, found.skipped)
            if not candidates:
                candidates = self.committed(stage, seq)
        return None

    def depth(self, stage: str, cursor: int) -> int:
        """How many committed entries of `stage` lie after `cursor`."""
        return len(self.committed(stage, cursor))

    # ---- quarantine -------------------------------------------------------------------------

    def quarantine(self, stage: str, seq: int, reason: str) -> str:
        """Set entry `seq` aside with `reason`: its bytes are copied to quarantine/ (a separate
        payload object is then deleted) and a note marks the seq as skipped for every reader.

        The log record stays, so the seq is never reused (a consumer past it would miss a new
        entry). Idempotent and safe when several readers find the same corruption.
        """
        base = f"quarantine/{stage}/{seq_name(seq)}"
        try:
            raw = self.store.read_bytes(log_path(stage, seq))
        except FileNotFoundError:
            raw = b""
        payload = None
        with contextlib.suppress(CorruptEntry):
            payload = decode_record(raw, "")[0]["payload"]
        moved, source = "", None
        if isinstance(payload, str) and payload.startswith(f"data/{stage}/"):
            source, target = payload, f"{base}.arrow"
        elif raw:
            source, target = log_path(stage, seq), f"{base}.record"
        if source is not None:
            try:
                self.store.write_immutable(target, self.store.read_bytes(source))
                moved = target
            except FileNotFoundError:
                pass
        note = {"stage": stage, "seq": seq, "reason": reason, "payload": payload, "moved_to": moved}
        note.update(time=time.time(), by=self.writer_id)
        if self.store.create_if_absent(f"{base}.json", json.dumps(note).encode()):
            log.error("queue %s entry %d quarantined: %s", stage, seq, reason)
        if moved and source != log_path(stage, seq):
            self.store.delete(source)
        return reason

    def quarantine_reason(self, stage: str, seq: int) -> str:
        path = f"quarantine/{stage}/{seq_name(seq)}.json"
        if not self.store.exists(path):
            return ""
        try:
            return str(json.loads(self.store.read_bytes(path)).get("reason", "unknown"))
        except (ValueError, FileNotFoundError):
            return "unreadable quarantine note"

    def quarantined(self, stage: str) -> list[dict[str, Any]]:
        """The quarantine notes of `stage`, oldest seq first."""
        _check_stage(stage)
        notes = []
        for name in self.store.list_dir(f"quarantine/{stage}"):
            if name.endswith(".json"):
                try:
                    notes.append(json.loads(self.store.read_bytes(f"quarantine/{stage}/{name}")))
                except (ValueError, FileNotFoundError):
                    notes.append({"stage": stage, "seq": name[:-5], "reason": "unreadable note"})
        return notes

    # ---- control ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every service of the run to exit (idempotent)."""
        body = json.dumps({"time": time.time(), "writer": self.writer_id}).encode()
        self.store.create_if_absent("control/stop", body)

    def stopped(self) -> bool:
        return self.store.exists("control/stop")

    def heartbeat(self, role: str, worker_id: str, info: dict[str, Any]) -> None:
        """Record that `role`/`worker_id` is alive, with a small JSON-serializable `info`."""
        _check_name_part("role", role)
        _check_name_part("worker_id", str(worker_id))
        body = {"role": role, "worker_id": str(worker_id), "time": time.time(), "info": info}
        try:
            data = json.dumps(body).encode()
        except (TypeError, ValueError) as err:
            raise ValueError(f"heartbeat info must be JSON-serializable: {err}") from err
        self.store.write_replace(f"control/heartbeats/{role}-{worker_id}", data)

    def heartbeats(self) -> list[dict[str, Any]]:
        beats = []
        for name in self.store.list_dir("control/heartbeats"):
            try:
                beats.append(json.loads(self.store.read_bytes(f"control/heartbeats/{name}")))
            except (ValueError, FileNotFoundError):
                continue
        return beats

    def _tail(self, stage: str) -> int:
        seqs = self.committed(stage)
        return seqs[-1] + 1 if seqs else 0
