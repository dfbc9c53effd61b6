"""TransferQueue: the append-only, multi-writer data bus between roles, on one storage prefix.

Layout under `{root}/{run_id}/` (see ARCHITECTURE.md, "The data bus"):
  data/{stage}/{uuid}.arrow   immutable payload (whole groups, Arrow IPC, zstd)
  log/{stage}/{seq:020d}      commit record naming one payload; created only if absent
  control/stop, control/heartbeats/{role}-{id}

put() writes the payload first and then commits the next free seq with create-if-absent, so a
payload is invisible until its record exists and two writers never share a seq: the loser of a
race moves on to a later seq. Readers walk seqs in order with a cursor they own.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from relax_core.queue.ipc import decode_table, encode_table
from relax_core.queue.schema import validate_table
from relax_core.queue.store import ObjectStore, probe_create_if_absent

STAGES = ("rollout", "ref", "fwd", "ready")
_SEQ_WIDTH = 20


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown queue stage {stage!r}; stages are {list(STAGES)}")


def _check_name_part(kind: str, value: str) -> None:
    if not value or "/" in value:
        raise ValueError(f"{kind} must be a non-empty name without '/', got {value!r}")


def _log_path(stage: str, seq: int) -> str:
    return f"log/{stage}/{seq:0{_SEQ_WIDTH}d}"


def _parse_seq(name: str) -> int | None:
    if len(name) == _SEQ_WIDTH and name.isdigit():
        return int(name)
    return None


class TransferQueue:
    """One run's queue: `put` appends a table to a stage, `next`/`read` consume it by seq."""

    def __init__(
        self,
        root: str,
        run_id: str,
        storage_options: dict[str, Any] | None = None,
        *,
        durable: bool = True,
    ) -> None:
        """`durable=False` skips fsync on local disk (see ObjectStore); no effect on object stores."""
        _check_name_part("run_id", run_id)
        self.run_id = run_id
        root_url = f"{str(root).rstrip('/')}/{run_id}"
        self.store = ObjectStore(root_url, storage_options, durable=durable)
        self.writer_id = uuid.uuid4().hex[:12]
        # Next seq to try per stage. Only a hint: create_if_absent decides who owns a seq.
        self._next_seq: dict[str, int] = {}
        self._create_checked = self.store.is_local

    def put(self, stage: str, table: pa.Table, meta: dict[str, Any] | None = None) -> int:
        """Append `table` (ROW_SCHEMA rows, whole groups) to `stage`; returns its seq."""
        _check_stage(stage)
        table = validate_table(table)
        try:
            meta_json = json.loads(json.dumps(meta))
        except (TypeError, ValueError) as err:
            raise ValueError(f"meta must be JSON-serializable: {err}") from err
        self._check_create_if_absent()
        payload = f"data/{stage}/{uuid.uuid4().hex}.arrow"
        self.store.write_immutable(payload, encode_table(table))
        record = {
            "payload": payload,
            "rows": table.num_rows,
            "groups": pc.count_distinct(table.column("group_id")).as_py(),
            "created": time.time(),
            "writer": self.writer_id,
            "meta": meta_json,
        }
        data = json.dumps(record).encode()
        seq = self._next_seq.get(stage)
        if seq is None:
            seq = self._tail(stage)
        while not self.store.create_if_absent(_log_path(stage, seq), data):
            # Lost the race: skip past everything committed meanwhile, not one seq at a time.
            seq = max(seq + 1, self._tail(stage))
        self._next_seq[stage] = seq + 1
        return seq

    def read(self, stage: str, seq: int) -> pa.Table:
        """The table committed at `seq` of `stage`; ValueError naming the object if it is corrupt."""
        _check_stage(stage)
        record = self._record(stage, seq)
        payload = record["payload"]
        table = decode_table(self.store.read_bytes(payload), self.store.url(payload))
        try:
            table = validate_table(table)
        except ValueError as err:
            raise ValueError(f"queue payload {self.store.url(payload)}: {err}") from err
        if table.num_rows != record["rows"]:
            raise ValueError(
                f"queue payload {self.store.url(payload)} has {table.num_rows} rows but its "
                f"commit record {self.store.url(_log_path(stage, seq))} says {record['rows']}"
            )
        return table

    def record(self, stage: str, seq: int) -> dict[str, Any]:
        """The commit record at `seq`: payload, rows, groups, created, writer, meta."""
        _check_stage(stage)
        return self._record(stage, seq)

    def committed(self, stage: str, after: int = -1) -> list[int]:
        """Sorted seqs of `stage` greater than `after`."""
        _check_stage(stage)
        seqs = (_parse_seq(n) for n in self.store.list_dir(f"log/{stage}"))
        return sorted(s for s in seqs if s is not None and s > after)

    def next(self, stage: str, cursor: int) -> tuple[int, pa.Table] | None:
        """The first committed (seq, table) after `cursor`, or None if there is none yet."""
        _check_stage(stage)
        # Seqs are dense in practice, so probing cursor + 1 avoids listing the whole log.
        if self.store.exists(_log_path(stage, cursor + 1)):
            seq = cursor + 1
        else:
            later = self.committed(stage, cursor)
            if not later:
                return None
            seq = later[0]
        return seq, self.read(stage, seq)

    def depth(self, stage: str, cursor: int) -> int:
        """How many committed entries of `stage` lie after `cursor`."""
        return len(self.committed(stage, cursor))

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

    def _tail(self, stage: str) -> int:
        seqs = self.committed(stage)
        return seqs[-1] + 1 if seqs else 0

    def _record(self, stage: str, seq: int) -> dict[str, Any]:
        path = _log_path(stage, seq)
        raw = self.store.read_bytes(path)
        try:
            record = json.loads(raw)
        except ValueError as err:
            raise ValueError(f"corrupt commit record {self.store.url(path)}: {err}") from err
        payload = record.get("payload") if isinstance(record, dict) else None
        if not payload or not isinstance(payload, str):
            raise ValueError(f"corrupt commit record {self.store.url(path)}: no 'payload' field")
        return record

    def _check_create_if_absent(self) -> None:
        if self._create_checked:
            return
        probe = f"control/probe/{self.writer_id}-{uuid.uuid4().hex}"
        if not probe_create_if_absent(self.store, probe):
            raise RuntimeError(
                f"storage at {self.store.url('')} does not enforce create-if-absent "
                "(If-None-Match: *), so concurrent writers could overwrite each other's commits; "
                "use storage that supports conditional writes"
            )
        self._create_checked = True
