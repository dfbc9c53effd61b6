"""Leases for multi-consumer stages: several workers share one input stage without double work.

A worker takes input entry `seq` by creating `claims/{stage}/{seq:020d}-{attempt:04d}` only if
absent; the body holds its id and an expiry. A lease that expired without its output being
committed (the worker crashed or hangs) is taken over by creating the next attempt; one held
under the same worker id by an earlier process (a restarted worker) is taken over at once.
Leases only avoid duplicate work: exactness comes from the output commit
(`TransferQueue.commit` at the input's seq), so a slow worker that outlives its lease cannot add
a second copy.

Expiry compares wall clocks of different machines; keep them NTP-synchronized and the TTL well
above the skew (the default is tens of seconds).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

from relax_core.queue.pruning import is_pruned
from relax_core.queue.queue import Entry, TransferQueue, log_path, parse_seq, seq_name

_ATTEMPT_WIDTH = 4


@dataclass(frozen=True)
class Lease:
    stage: str
    seq: int
    attempt: int
    worker: str
    expires: float

    @property
    def path(self) -> str:
        return f"claims/{self.stage}/{seq_name(self.seq)}-{self.attempt:0{_ATTEMPT_WIDTH}d}"


def _parse_claim(name: str) -> tuple[int, int] | None:
    seq_part, _, attempt = name.rpartition("-")
    seq = parse_seq(seq_part)
    if seq is None or len(attempt) != _ATTEMPT_WIDTH or not attempt.isdigit():
        return None
    return seq, int(attempt)


def latest_claims(queue: TransferQueue, stage: str) -> dict[int, int]:
    """seq -> highest claim attempt for every claimed entry of `stage` (one listing)."""
    latest: dict[int, int] = {}
    for name in queue.store.list_dir(f"claims/{stage}"):
        parsed = _parse_claim(name)
        if parsed is not None:
            seq, attempt = parsed
            latest[seq] = max(attempt, latest.get(seq, -1))
    return latest


class StageWorker:
    """One worker of a multi-consumer stage: claims input entries whose output is not committed.

    Loop: `for lease, entry in worker.claim()` ... `worker.complete(lease, table)`. `claim`
    yields at most one lease at a time and nothing when all pending entries are leased.
    """

    def __init__(
        self,
        queue: TransferQueue,
        in_stage: str,
        out_stage: str,
        worker_id: str,
        lease_ttl_s: float = 60.0,
    ) -> None:
        if lease_ttl_s <= 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        self.queue = queue
        self.in_stage = in_stage
        self.out_stage = out_stage
        self.worker_id = worker_id
        self.lease_ttl_s = lease_ttl_s
        self.taken_over = 0
        # Listings cost a request per 1,000 names and grow with the run, so what is already
        # known stays known: input seqs seen, seqs whose output exists, and when each seen
        # lease runs out (its body is read once; a renewal only delays a takeover check).
        self._inputs: list[int] = []
        self._done: set[int] = set()
        self._expiry: dict[tuple[int, int], float] = {}
        self._mine: set[tuple[int, int]] = set()

    def known_inputs(self) -> list[int]:
        """Input seqs seen by the last listing (no storage call)."""
        return list(self._inputs)

    def pending(self) -> list[int]:
        """Committed input seqs whose output is not committed yet, oldest first (two listings)."""
        self._done.update(self.queue.committed(self.out_stage))
        self._inputs = self.queue.committed(self.in_stage)
        return [s for s in self._inputs if s not in self._done]

    def _body(self, expires: float, attempt: int) -> bytes:
        return json.dumps(
            {"worker": self.worker_id, "expires": expires, "attempt": attempt, "time": time.time()}
        ).encode()

    def _try(self, seq: int, attempt: int) -> Lease | None:
        expires = time.time() + self.lease_ttl_s
        lease = Lease(self.in_stage, seq, attempt, self.worker_id, expires)
        if self.queue.store.create_if_absent(lease.path, self._body(expires, attempt)):
            self._mine.add((seq, attempt))
            return lease
        return None

    def _expires(self, seq: int, attempt: int) -> float:
        key = (seq, attempt)
        if key not in self._expiry or self._expiry[key] < time.time():
            path = Lease(self.in_stage, seq, attempt, "", 0.0).path
            try:
                body = json.loads(self.queue.store.read_bytes(path))
                self._expiry[key] = float(body["expires"])
                if body.get("worker") == self.worker_id and key not in self._mine:
                    # Held under this worker's id by an earlier process of it, which is dead
                    # (a worker id runs one process at a time): no need to wait it out.
                    self._expiry[key] = 0.0
            except FileNotFoundError:
                self._expiry[key] = time.time() + self.lease_ttl_s
            except (ValueError, KeyError, TypeError):
                self._expiry[key] = 0.0  # an unreadable lease protects nothing
        return self._expiry[key]

    def _take_over(self, latest: dict[int, int]) -> Lease | None:
        now = time.time()
        for seq in sorted(latest):
            if seq in self._done or self._expires(seq, latest[seq]) >= now:
                continue
            if self.queue.store.exists(log_path(self.out_stage, seq)):
                self._done.add(seq)
                continue
            lease = self._try(seq, latest[seq] + 1)
            if lease is not None:
                self.taken_over += 1
                return lease
        return None

    def claim_next(self) -> Lease | None:
        """A lease on an entry whose lease expired without an output (oldest work first: readers
        downstream may wait on it), else on the oldest entry nobody holds, or None."""
        latest = latest_claims(self.queue, self.in_stage)
        lease = self._take_over(latest)
        if lease is not None:
            return lease
        for refresh in (False, True):
            if refresh:
                self._inputs = self.queue.committed(self.in_stage)
            for seq in self._inputs:
                if seq not in latest and seq not in self._done:
                    lease = self._try(seq, 0)
                    if lease is not None:
                        return lease
        return None

    def claim(self) -> Iterator[tuple[Lease, Entry]]:
        """Yield (lease, input entry) for pending entries; a quarantined input gets a tombstone
        in the output stage right here, so it is not offered again."""
        while True:
            lease = self.claim_next()
            if lease is None:
                return
            try:
                found = self.queue.entry(self.in_stage, lease.seq)
            except FileNotFoundError:
                if not is_pruned(self.queue.store, self.in_stage, lease.seq):
                    raise
                # Listed before retention deleted it (its output existed): nothing to do.
                self.queue.store.delete(lease.path)
                self._done.add(lease.seq)
                continue
            if found.table is None:
                self.queue.commit_tombstone(
                    self.out_stage, lease.seq, f"{self.in_stage} {found.skipped}"
                )
                self._done.add(lease.seq)
                continue
            yield lease, found

    def renew(self, lease: Lease) -> Lease:
        """Extend `lease` (for long work); only its holder writes this attempt's object."""
        expires = time.time() + self.lease_ttl_s
        renewed = Lease(lease.stage, lease.seq, lease.attempt, lease.worker, expires)
        self.queue.store.write_replace(renewed.path, self._body(expires, lease.attempt))
        return renewed

    def complete(self, lease: Lease, table, meta: dict | None = None) -> bool:
        """Commit the output of `lease`'s input at the same seq; False if another worker did."""
        meta = dict(meta or {})
        meta.update(source_stage=lease.stage, source_seq=lease.seq, lease_attempt=lease.attempt)
        meta.setdefault("worker", self.worker_id)
        won = self.queue.commit(self.out_stage, lease.seq, table, meta)
        self._done.add(lease.seq)
        return won
