"""The receiving end of the broadcast weight-sync group (see broadcast.py for the protocol).

A rollout engine or actor_fwd process joins the group its trainer published, then a background
thread receives every update into staging buffers and hands complete ones to the engine loop.
When the group breaks (the trainer or another member died), the thread leaves it and joins the
next generation the trainer forms, while the engine goes on generating with the weights it has.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relax_core.queue.store import ObjectStore
from relax_core.sync.apply import StagingPool, Update, UpdateSlot, UpdateTensors
from relax_core.sync.broadcast_group import (
    CONNECT_TRY_S,
    END,
    FORMING,
    OP_NAMES,
    POLL_S,
    STOP,
    UPDATE,
    ProtocolError,
    check_member,
    describe_layout_row,
    device_for,
    layout_check,
    leave_groups,
    rendezvous_path,
    sync_groups,
    waiting_path,
)
from relax_core.sync.buckets import (
    LayoutMismatch,
    TensorSpec,
    dtype_of,
    layout_difference,
    layout_fingerprint,
    layout_from_json,
    plan_buckets,
    unflatten,
)


class BroadcastReceiver:
    """The member `member` of the group; stages updates in a thread for `take()`.

    Its rank is the one the sender's record gives that name, and may change from one generation
    to the next (members come and go).

    `timeout_s` bounds finding the rendezvous record and joining the group. Between updates a
    receiver waits for as long as the trainer takes, up to `idle_timeout_s` (gloo and NCCL fail
    a collective that waits longer than the group's timeout); a sender that dies closes its
    connections, which fails the wait at once on gloo.
    """

    def __init__(
        self,
        store: ObjectStore,
        group: str,
        member: str,
        specs: list[TensorSpec],
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 300.0,
        idle_timeout_s: float = 7 * 24 * 3600.0,
    ) -> None:
        self.store = store
        self.group = group
        self.path = rendezvous_path(group)
        self.member = check_member(member)
        self.rank = 0
        """This member's rank in the generation it joined last (0: none yet)."""
        self.specs = list(specs)
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.specs, bucket_bytes)
        self.fingerprint = layout_fingerprint(self.specs)
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.device = torch.device("cpu")
        self._slot = UpdateSlot()
        self._pool = StagingPool()
        self._thread: threading.Thread | None = None
        self._joined = False
        self._pg: Any = None
        self._ctrl: Any = None
        self._ctrl_device = self.device
        self._nonce = ""
        self.rejoins = 0
        """Generations joined after the first (the group broke and was formed again)."""

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        self._join(time.monotonic() + self.timeout_s)

    def _join(self, deadline: float) -> None:
        record, tcp = self._connect(deadline)
        self.rank = int(record["members"][self.member])
        backend = record["backend"]
        self.device = device_for(backend)
        # CUDA's caching allocator already reuses freed staging; a held free set would only
        # take GPU memory from the engine.
        self._pool = StagingPool(keep=0 if self.device.type == "cuda" else 1)
        tcp.set_timeout(timedelta(seconds=max(1.0, deadline - time.monotonic())))
        idle = timedelta(seconds=self.idle_timeout_s)
        try:
            self._pg, self._ctrl, self._ctrl_device = sync_groups(
                backend,
                tcp,
                self.rank,
                int(record["world_size"]),
                record["nonce"],
                # The data group carries the wait for the next update unless headers have a
                # group of their own (NCCL).
                idle if backend == "gloo" else timedelta(seconds=self.timeout_s),
                idle,
            )
        except Exception as err:
            raise TimeoutError(
                f"weight sync group {self.group!r}: {self.member} (rank {self.rank}) could not "
                "join the group "
                f"at {record['addr']}:{record['port']} ({type(err).__name__}: {err})"
            ) from err
        self._joined = True
        self._nonce = record["nonce"]
        with contextlib.suppress(FileNotFoundError):
            self.store.delete(waiting_path(self.group, self.member))
        rows = layout_check(
            self.fingerprint, len(self.specs), self.bucket_bytes, self._ctrl, self._ctrl_device
        )
        if any(row != rows[0] for row in rows):
            self._leave_groups()
            self._joined = False
            raise LayoutMismatch(self._mismatch_message(record, rows))

    def start(self) -> None:
        """Receive updates in a daemon thread until STOP."""
        if not self._joined:
            raise RuntimeError(f"weight sync group {self.group!r}: start() before init()")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"weight-sync-{self.group}-{self.member}", daemon=True
            )
            self._thread.start()

    def destroy(self, timeout: float = 30.0) -> None:
        """Leave the group once the thread has ended (after STOP or an error).

        A thread still waiting on the sender cannot be interrupted; it is left behind (it is a
        daemon) together with the group, and destroy returns.
        """
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return
        if self._joined:
            self._leave_groups()
            self._joined = False

    # ------------------------------------------------------------------ engine side
    def take(self) -> Update | None:
        """The newest complete update not yet taken (version, named tensors), or None.

        Its tensors are the caller's: the receiver never writes them again, unless the caller
        gives them back with `release`.
        """
        return self._slot.take()

    def release(self, update: Update) -> None:
        """Give a taken update's staging back for reuse, once nothing uses its tensors (e.g.
        after `engine.update_weights` copied them; `apply_update(..., receiver.release)`)."""
        self._pool.release(update[1])

    def wait(self, timeout: float) -> bool:
        """Block until an update is pending, STOP arrived or the thread failed; True if pending."""
        return self._slot.wait(timeout)

    @property
    def stopped(self) -> bool:
        return self._slot.stopped

    @property
    def in_group(self) -> bool:
        """Whether this receiver is a member of a formed generation now (between generations,
        after the trainer left it out, it is not)."""
        return self._joined

    # ------------------------------------------------------------------ internals
    def _connect(self, deadline: float) -> tuple[dict, dist.TCPStore]:
        """Read the rendezvous record and connect to its store; a record left by a dead sender
        is read again until a live one appears or the deadline passes."""
        last_error = ""
        while True:
            record = self._read_record(deadline)
            remaining = deadline - time.monotonic()
            try:
                tcp = dist.TCPStore(
                    record["addr"],
                    int(record["port"]),
                    int(record["world_size"]),
                    is_master=False,
                    timeout=timedelta(seconds=max(1.0, min(remaining, CONNECT_TRY_S))),
                )
                return record, tcp
            except RuntimeError as err:
                last_error = f"{type(err).__name__}: {err}"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight sync group {self.group!r}: could not connect to the sender at "
                    f"{record['addr']}:{record['port']} (from {self.store.url(self.path)}) "
                    f"within {self.timeout_s:.0f}s; last error: {last_error}"
                )
            time.sleep(POLL_S)

    def _read_record(self, deadline: float) -> dict:
        """The record of a group that is forming, names this member, and is not the one this
        receiver left. While waiting, a marker under `waiting_path` asks the sender to form one."""
        marker = waiting_path(self.group, self.member)
        self.store.write_replace(marker, json.dumps({"since": time.time()}).encode())
        while True:
            try:
                record = json.loads(self.store.read_bytes(self.path))
                if (
                    record.get("state") == FORMING
                    and record.get("nonce") != self._nonce
                    and self.member in record.get("members", {})
                ):
                    return record
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight sync group {self.group!r}: no rendezvous record of a forming group "
                    f"with member {self.member!r} at {self.store.url(self.path)} within "
                    f"{self.timeout_s:.0f}s; is the trainer (the sender) running, using the same "
                    "queue root and group name, and does it expect this member?"
                )
            time.sleep(POLL_S)

    def _mismatch_message(self, record: dict, rows: list[list[int]]) -> str:
        what = []
        if row_differs := rows[self.rank] != rows[0]:
            diff = layout_difference(self.specs, layout_from_json(record.get("layout", [])))
            if diff:
                what.append(f"weight layout differs at {diff}")
            if self.bucket_bytes != int(record["bucket_bytes"]):
                what.append(
                    f"bucket_bytes here {self.bucket_bytes}, sender {record['bucket_bytes']}"
                )
        bad = [rank for rank, row in enumerate(rows) if row != rows[0]]
        where = "this receiver" if row_differs else f"receiver rank(s) {bad}"
        return (
            f"weight sync group {self.group!r}: {where} disagree(s) with the sender "
            f"({'; '.join(what) or describe_layout_row(rows[bad[0]])}); 'here' is {self.member}, "
            "'there' the sender; build the trainer's architecture and use its bucket_bytes"
        )

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while not self._receive_until_stop():
                # The group broke (a peer died): leave it, join the trainer's next generation.
                self.leave_groups()
                self._join(time.monotonic() + self.idle_timeout_s)
                self.rejoins += 1
        except BaseException as err:  # surfaced to the engine loop by take()/wait()
            self._slot.fail(err)

    def _receive_until_stop(self) -> bool:
        """Receive updates; True after STOP, False when the group broke under a receive."""
        while True:
            try:
                op, version, n_buckets = self._recv_header()
                if op == STOP:
                    self._slot.stop()
                    return True
                self._expect_header(op, UPDATE, n_buckets)
                tensors = self._recv_buckets()
                end, end_version, n_buckets = self._recv_header()
            except ProtocolError:
                raise
            except RuntimeError:  # gloo: connection closed / reset by a dead peer
                return False
            self._expect_header(end, END, n_buckets)
            if end_version != version:
                raise ProtocolError(
                    f"weight sync group {self.group!r}: update {version} ended as "
                    f"{end_version} (protocol error)"
                )
            replaced = self._slot.put((version, tensors))
            if replaced is not None:  # never taken: its staging is free
                self._pool.release(replaced[1])

    def leave_groups(self) -> None:
        with contextlib.suppress(Exception):
            self._leave_groups()
        self._joined = False

    def _leave_groups(self) -> None:
        leave_groups(self._ctrl, self._pg)
        self._pg = self._ctrl = None

    def _recv_header(self) -> tuple[int, int, int]:
        header = torch.empty(3, dtype=torch.int64, device=self._ctrl_device)
        dist.broadcast(header, src=0, group=self._ctrl)
        op, version, n_buckets = header.tolist()
        return op, version, n_buckets

    def _expect_header(self, op: int, expected: int, n_buckets: int) -> None:
        if op != expected or n_buckets != len(self.buckets):
            raise ProtocolError(
                f"weight sync group {self.group!r}: expected a {OP_NAMES[expected]} header for "
                f"{len(self.buckets)} buckets, got op {OP_NAMES.get(op, op)} for {n_buckets} "
                "(protocol error)"
            )

    def _recv_buckets(self) -> UpdateTensors:
        # Staging is fresh or given back (StagingPool): what take() handed out and was not
        # released is never written again.
        flats = self._pool.acquire(self._new_staging)
        works = [dist.broadcast(flat, src=0, async_op=True, group=self._pg) for flat in flats[:2]]
        for i in range(len(flats)):
            works[i].wait()
            if i + 2 < len(flats):
                works.append(dist.broadcast(flats[i + 2], src=0, async_op=True, group=self._pg))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        by_name = dict(
            pair
            for bucket, flat in zip(self.buckets, flats, strict=True)
            for pair in unflatten(bucket, flat)
        )
        tensors = UpdateTensors((s.name, by_name[s.name]) for s in self.specs)
        self._pool.lease(tensors, flats)
        return tensors

    def _new_staging(self) -> list[torch.Tensor]:
        return [
            torch.empty(b.numel, dtype=dtype_of(b.dtype), device=self.device) for b in self.buckets
        ]
