"""Staleness as admission control: bound how far rollout runs ahead instead of discarding.

Pure functions (no I/O) shared by rollout workers and the trainer; `AdmissionLedger` keeps the
one shared count they need (groups started, by policy version) on the queue's storage.

With `k = max_staleness` and `G = groups_per_step`:
- rollout may start a group under policy version v only while `started < (v + k + 1) * G`
  (`started` leaves out blocks voided by their worker's restart, see `AdmissionLedger.reclaim`);
- the trainer fills a step batch oldest behaviour version first and does not take a group while
  a group of an older version is still being generated (`select_step_groups`).
Together these bound the staleness of every trained group by k: the groups trained in steps
0..s-1 are always the s*G oldest admitted, and a group admitted as the i-th under version v has
i < (v + k + 1) * G, so it is trained at a step <= v + k. A hard drop of over-stale groups is
only a configured backstop (`split_over_stale`), counted by the caller.

Dynamic sampling (DAPO) drops generated groups whose rewards are all equal and draws fresh
prompts instead. `record_dropped` writes such groups beside the voided blocks, so `started` counts
only groups kept or still being generated, and the argument above runs over kept groups: when a
kept group is admitted under v, fewer than (v + k + 1) * G kept-or-generating groups precede it
(groups dropped later only made that count larger), the trainer trains only kept groups, G per
step, oldest first, so it is trained at a step <= v + k. Counting dropped groups instead would
shrink the bound with every drop until the trainer could never fill a step (with k = 0: G
admitted under v, one dropped, rollout at the bound, the trainer waiting for a G-th group of v);
raising the limit by the number dropped is the same rule as not counting them. Kept groups still
run at most k versions ahead; drawn-and-dropped ones cost only compute, which
`rollout.max_sampling_rounds` bounds (roles/rollout_service.py).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from relax_core.queue.queue import TransferQueue, parse_seq, seq_name


def _check(max_staleness: int, groups_per_step: int) -> None:
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if groups_per_step < 1:
        raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")


def admission_limit(policy_version: int, max_staleness: int, groups_per_step: int) -> int:
    """How many groups may have been started in total while the policy is at `policy_version`."""
    _check(max_staleness, groups_per_step)
    return (policy_version + max_staleness + 1) * groups_per_step


def may_start_group(
    groups_started: int, policy_version: int, max_staleness: int, groups_per_step: int
) -> bool:
    """Whether rollout may start one more group now."""
    return groups_started < admission_limit(policy_version, max_staleness, groups_per_step)


def admissible(
    groups_started: int, policy_version: int, max_staleness: int, groups_per_step: int
) -> int:
    """How many more groups rollout may start now (0 = wait for the next policy version)."""
    limit = admission_limit(policy_version, max_staleness, groups_per_step)
    return max(0, limit - groups_started)


def select_step_groups(
    available: Sequence[tuple[str, int]], in_flight_versions: Iterable[int], groups_per_step: int
) -> list[str] | None:
    """The group ids of the next step batch, or None if it cannot be filled yet.

    `available`: (group_id, behaviour_version_min) of finished, untrained groups.
    `in_flight_versions`: behaviour versions of groups started but not finished.
    Oldest version first; a group newer than the oldest in-flight group is not eligible (taking
    it would let that older group fall behind the staleness bound).
    """
    oldest_in_flight = min(in_flight_versions, default=None)
    eligible = sorted(
        (version, group_id)
        for group_id, version in available
        if oldest_in_flight is None or version <= oldest_in_flight
    )
    if len(eligible) < groups_per_step:
        return None
    return [group_id for _, group_id in eligible[:groups_per_step]]


def staleness(train_version: int, behaviour_version_min: int) -> int:
    """Versions between the weights that generated a sample and the weights that train on it."""
    return train_version - behaviour_version_min


def staleness_histogram(train_version: int, behaviour_versions: Iterable[int]) -> dict[int, int]:
    """staleness -> count, e.g. over the groups of one step batch."""
    return dict(sorted(Counter(staleness(train_version, v) for v in behaviour_versions).items()))


def split_over_stale(
    table: pa.Table, train_version: int, max_staleness: int
) -> tuple[pa.Table, int]:
    """(rows of groups within the bound, number of whole groups dropped): the backstop."""
    if table.num_rows == 0:
        return table, 0
    oldest = table.group_by("group_id").aggregate([("behaviour_version_min", "min")])
    versions = oldest.column("behaviour_version_min_min")
    stale = pc.less(versions, train_version - max_staleness)
    stale_ids = pc.filter(oldest.column("group_id"), stale)
    if len(stale_ids) == 0:
        return table, 0
    keep = pc.invert(pc.is_in(table.column("group_id"), value_set=stale_ids))
    return table.filter(keep), len(stale_ids)


VOID = "tickets-void"
"""Blocks voided by their worker's restart, and groups dropped by dynamic sampling (records with
`reason: dynamic_sampling`): neither counts against the bound, the trainer no longer waits for
them."""
DROPPED = "dynamic_sampling"
"""The `reason` of a `tickets-void/` record of dropped groups (their prompts are consumed)."""


class AdmissionLedger:
    """The shared count of started groups: `tickets/{first:020d}` records of admitted blocks.

    Each record admits `count` groups under one policy version; the next block starts at
    first + count and is created only if absent, so concurrent rollout workers never admit more
    than the limit between them.
    """

    def __init__(self, queue: TransferQueue) -> None:
        self.queue = queue
        self._void_counts: dict[str, int] = {}
        self.stream_first = 0
        """The first stream position of the block this ledger admitted last (`try_admit`)."""

    def _last(self) -> tuple[int, dict] | None:
        names = [n for n in self.queue.store.list_dir("tickets") if parse_seq(n) is not None]
        if not names:
            return None
        first = int(names[-1])
        return first, json.loads(self.queue.store.read_bytes(f"tickets/{names[-1]}"))

    def started(self) -> int:
        last = self._last()
        return 0 if last is None else last[0] + int(last[1]["count"])

    def try_admit(
        self,
        want: int,
        policy_version: int,
        max_staleness: int,
        groups_per_step: int,
        worker: str = "",
        stream_first: int | None = None,
    ) -> tuple[int, int]:
        """Admit up to `want` groups now: (first ticket, count); count 0 means wait.

        The block's prompts are stream positions `stream_first`.. when given (a block that
        replaces a voided one generates the very prompts the voided one held), else the next
        fresh ones: every record keeps `stream_next`, which a replacement block does not
        advance, so the stream neither skips nor repeats positions across restarts. The
        positions of the block admitted last are in `self.stream_first`."""
        if want < 1:
            raise ValueError(f"want must be >= 1, got {want}")
        while True:
            last = self._last()
            started = 0 if last is None else last[0] + int(last[1]["count"])
            # Records from before `stream_next` existed: every block was fresh, at its tickets.
            fresh = 0 if last is None else int(last[1].get("stream_next", started))
            # Voided blocks were never generated; their prompts went into new blocks, which
            # count instead (else each restart would shrink the bound for good). Dropped groups
            # (dynamic sampling) make room for the new prompts drawn to replace them.
            live = started - self.voided_groups()
            count = min(want, admissible(live, policy_version, max_staleness, groups_per_step))
            if count == 0:
                return started, 0
            first_position = fresh if stream_first is None else stream_first
            body = {
                "count": count,
                "policy_version": policy_version,
                "worker": worker,
                "time": time.time(),
                "stream_first": first_position,
                "stream_next": fresh + count if stream_first is None else fresh,
            }
            if self.queue.store.create_if_absent(
                f"tickets/{seq_name(started)}", json.dumps(body).encode()
            ):
                self.stream_first = first_position
                return started, count

    def record_dropped(
        self, first: int, group_ids: Sequence[str], policy_version: int, worker: str = ""
    ) -> bool:
        """Record that `group_ids` of the block at ticket `first`, admitted under
        `policy_version`, were generated and dropped (dynamic sampling: equal rewards), as
        `tickets-void/{first}`. Like a voided block's, these groups no longer count against the
        bound and the trainer stops waiting for them; unlike one, their prompts are consumed (as
        in colocate, DAPO draws new prompts), so `reclaim` never regenerates them.

        Written after the block's kept groups are committed (or when none was kept); a block
        that reached the rollout stage is never voided, so the name is the block's alone.
        Idempotent: returns whether this call wrote the record."""
        if not group_ids:
            return False
        body = {
            "count": len(group_ids),
            "policy_version": policy_version,
            "worker": worker,
            "time": time.time(),
            "reason": DROPPED,
            "groups": list(map(str, group_ids)),
        }
        return self.queue.store.create_if_absent(
            f"{VOID}/{seq_name(first)}", json.dumps(body).encode()
        )

    def dropped(self) -> dict[int, dict]:
        """Records of groups dropped by dynamic sampling: first ticket of their block -> record."""
        return {k: v for k, v in self.voided().items() if v.get("reason") == DROPPED}

    def blocks(self) -> dict[int, dict]:
        """Every admitted block: first ticket -> its record."""
        store = self.queue.store
        names = [n for n in store.list_dir("tickets") if parse_seq(n) is not None]
        return {int(n): json.loads(store.read_bytes(f"tickets/{n}")) for n in names}

    def voided_groups(self) -> int:
        """Groups in voided blocks (one listing; the records are read once and remembered)."""
        store = self.queue.store
        for name in store.list_dir(VOID):
            if name not in self._void_counts and parse_seq(name) is not None:
                body = json.loads(store.read_bytes(f"{VOID}/{name}"))
                self._void_counts[name] = int(body["count"])
        return sum(self._void_counts.values())

    def voided(self) -> dict[int, dict]:
        """Blocks given up (their worker died before committing them) and groups dropped by
        dynamic sampling (`dropped`): first ticket -> record."""
        store = self.queue.store
        names = [n for n in store.list_dir(VOID) if parse_seq(n) is not None]
        return {int(n): json.loads(store.read_bytes(f"{VOID}/{n}")) for n in names}

    def reclaim(self, worker: str, committed: set[int]) -> list[tuple[int, int]]:
        """Void `worker`'s blocks that never reached the rollout stage (it died holding them)
        and return their prompts as (stream_first, count) to generate again in new blocks.

        Only the worker's own restart calls this, so no live process still holds the blocks. A
        block whose groups were all dropped (a `record_dropped` record) is done, not voided."""
        voided = self.voided()
        redo = []
        for first, body in sorted(self.blocks().items()):
            if body.get("worker") != worker or first in committed or first in voided:
                continue
            self.queue.store.create_if_absent(
                f"{VOID}/{seq_name(first)}", json.dumps(body).encode()
            )
            redo.append((int(body.get("stream_first", first)), int(body["count"])))
        return redo

    def started_by_version(self) -> dict[int, int]:
        """policy version -> groups admitted under it."""
        counts: Counter[int] = Counter()
        for name in self.queue.store.list_dir("tickets"):
            if parse_seq(name) is not None:
                body = json.loads(self.queue.store.read_bytes(f"tickets/{name}"))
                counts[int(body["policy_version"])] += int(body["count"])
        return dict(sorted(counts.items()))
