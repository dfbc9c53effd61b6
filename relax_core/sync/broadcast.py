"""Weight sync over a torch.distributed broadcast group: trainer (rank 0) -> rollout engines.

Parts:
- rendezvous: the sender opens a TCPStore on a free port of `host` and publishes its address in
  `control/rendezvous/{group}` on the run's object store; receivers poll that record and join.
  All ranks then exchange a layout check (fingerprint, tensor count, bucket size), so a
  mismatched receiver fails init on both sides with a message instead of corrupting weights.
- wire format: every message starts with an int64 header [op, version, n_buckets]. An update is
  UPDATE header (`pause`), one broadcast per bucket (`send`), END header (`resume`); STOP ends
  the receivers' loop (`destroy`).
- `BroadcastSender.send` flattens bucket i+1 while bucket i is on the wire (two buffers).
- `BroadcastReceiver` runs a thread that receives each update into staging buffers of its own
  (fresh, or given back through `release`) and hands the complete update to the engine loop
  through an `UpdateSlot` (see apply.py).

Backend "gloo" moves CPU tensors, "nccl" CUDA tensors of the current device; the code is the same
(with NCCL, headers and the layout check go over a second, gloo group).
The group is torch's default process group, so a process holds one transport at a time. Gloo picks
its network interface from the hostname (set GLOO_SOCKET_IFNAME to choose one).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relax_core.queue.store import ObjectStore
from relax_core.sync.apply import StagingPool, Update, UpdateSlot, UpdateTensors
from relax_core.sync.buckets import (
    LayoutMismatch,
    NamedTensors,
    TensorSpec,
    check_tensors,
    dtype_of,
    flat_view,
    flatten_into,
    layout_difference,
    layout_fingerprint,
    layout_from_json,
    layout_to_json,
    plan_buckets,
    unflatten,
)

UPDATE, END, STOP = 1, 2, 3
_OPS = {UPDATE: "UPDATE", END: "END", STOP: "STOP"}
_POLL_S = 0.2
_CONNECT_TRY_S = 5.0


def rendezvous_path(group: str) -> str:
    if not group or "/" in group:
        raise ValueError(f"weight sync group name must be non-empty without '/', got {group!r}")
    return f"control/rendezvous/{group}"


def _device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    raise ValueError(f"weight sync backend must be 'gloo' (CPU) or 'nccl' (CUDA), got {backend!r}")


def _control_group(backend: str, timeout: timedelta) -> tuple[Any, torch.device]:
    """The group and device of headers and the layout check (None: the default group).

    With NCCL they travel over a gloo group: a receiver waiting for the next update then blocks
    a CPU thread instead of keeping an NCCL kernel spinning on the GPU beside the engine's.
    """
    if backend == "nccl":
        return dist.new_group(backend="gloo", timeout=timeout), torch.device("cpu")
    return None, _device_for(backend)


def _layout_check(
    fingerprint: str, n_tensors: int, bucket_bytes: int, group: Any, device: torch.device
) -> list[list[int]]:
    """Every rank's [fingerprint bytes..., n_tensors, bucket_bytes], gathered without pickle."""
    mine = torch.tensor(
        [*bytes.fromhex(fingerprint), n_tensors, bucket_bytes], dtype=torch.int64, device=device
    )
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def _describe_row(row: list[int]) -> str:
    return f"fingerprint {bytes(row[:32]).hex()[:12]}, {row[32]} tensors, bucket_bytes {row[33]}"


class BroadcastSender:
    """Rank 0 of the group: pushes the trainer's named parameters to `world_size - 1` receivers."""

    def __init__(
        self,
        store: ObjectStore,
        group: str,
        world_size: int,
        specs: list[TensorSpec],
        bucket_bytes: int = 64 << 20,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ) -> None:
        if world_size < 2:
            raise ValueError(
                f"world_size counts the sender and its receivers: >= 2, got {world_size}"
            )
        self.store = store
        self.group = group
        self.path = rendezvous_path(group)
        self.world_size = world_size
        self.specs = list(specs)
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.specs, bucket_bytes)
        self.fingerprint = layout_fingerprint(self.specs)
        self.backend = backend
        self.host = host
        self.timeout_s = timeout_s
        self.device = _device_for(backend)
        self._nonce = ""
        self._state = "new"  # new -> idle <-> paused -> sent -> idle ... -> destroyed
        self._version: int | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._ctrl: Any = None
        self._ctrl_device = self.device

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"weight sync group {self.group!r}: init() was already called")
        timeout = timedelta(seconds=self.timeout_s)
        tcp = dist.TCPStore(
            self.host, 0, self.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self._nonce = uuid.uuid4().hex
        record = {
            "addr": self.host,
            "port": tcp.port,
            "world_size": self.world_size,
            "backend": self.backend,
            "fingerprint": self.fingerprint,
            "bucket_bytes": self.bucket_bytes,
            "layout": layout_to_json(self.specs),
            "nonce": self._nonce,
            "time": time.time(),
        }
        self.store.write_replace(self.path, json.dumps(record).encode())
        try:
            dist.init_process_group(
                self.backend, store=tcp, rank=0, world_size=self.world_size, timeout=timeout
            )
        except Exception as err:
            self._forget_record()
            raise TimeoutError(
                f"weight sync group {self.group!r}: not all of its {self.world_size - 1} receiver(s) "
                f"joined within {self.timeout_s:.0f}s (rendezvous at {self.store.url(self.path)}; "
                f"{type(err).__name__}: {err})"
            ) from err
        self._ctrl, self._ctrl_device = _control_group(self.backend, timeout)
        rows = _layout_check(
            self.fingerprint, len(self.specs), self.bucket_bytes, self._ctrl, self._ctrl_device
        )
        bad = [rank for rank, row in enumerate(rows) if row != rows[0]]
        if bad:
            dist.destroy_process_group()
            self._forget_record()
            self._state = "destroyed"
            raise LayoutMismatch(
                f"weight sync group {self.group!r}: receiver rank(s) {bad} hold another weight "
                f"layout than the sender (sender: {_describe_row(rows[0])}; rank {bad[0]}: "
                f"{_describe_row(rows[bad[0]])}); every receiver must build the trainer's "
                "architecture and use its bucket_bytes"
            )
        self._state = "idle"

    def destroy(self) -> None:
        """End the receivers' loops (STOP) and leave the group; safe to call twice."""
        if self._state in ("new", "destroyed"):
            self._state = "destroyed"
            return
        try:
            if self._state == "sent" or (self._state == "paused" and self._version is None):
                self.resume()
            if self._state == "idle":
                self._header(STOP, -1)
        finally:
            dist.destroy_process_group()
            self._forget_record()
            self._buffers = [None, None]
            self._state = "destroyed"

    # ------------------------------------------------------------------ one update
    def pause(self, version: int | None = None) -> None:
        """Announce an update (receivers start staging). Without `version` the announcement
        goes out with `send`, which then carries the version."""
        self._expect("idle", "pause()")
        self._version = version
        if version is not None:
            self._header(UPDATE, version)
        self._state = "paused"

    def send(self, named_tensors: NamedTensors, version: int) -> None:
        """Broadcast every bucket; ValueError (nothing sent) if a tensor is missing or misfits."""
        self._expect("paused", "send()")
        tensors = check_tensors(self.specs, named_tensors)
        if self._version is None:
            self._header(UPDATE, version)
            self._version = version
        elif version != self._version:
            raise ValueError(f"send(version={version}) after pause(version={self._version})")
        with torch.no_grad():
            self._broadcast_buckets(tensors)
        self._state = "sent"

    def resume(self) -> None:
        """Mark the update complete: receivers hand it to their engines."""
        if self._state == "paused" and self._version is None:
            self._state = "idle"  # nothing was announced, nothing to end
            return
        if self._state == "paused":
            raise RuntimeError(
                f"weight sync group {self.group!r}: resume() after pause({self._version}) "
                "without send(); receivers are waiting for the buckets of that version"
            )
        self._expect("sent", "resume()")
        self._header(END, self._version if self._version is not None else -1)
        self._state = "idle"

    def push(self, named_tensors: NamedTensors, version: int) -> None:
        """pause -> send -> resume: one complete update (checked before anything is sent)."""
        tensors = list(check_tensors(self.specs, named_tensors).items())
        self.pause(version)
        self.send(tensors, version)
        self.resume()

    # ------------------------------------------------------------------ internals
    def _expect(self, state: str, what: str) -> None:
        if self._state != state:
            raise RuntimeError(
                f"weight sync group {self.group!r}: {what} needs state {state!r}, it is "
                f"{self._state!r} (order: init, then pause/send/resume per update, destroy)"
            )

    def _header(self, op: int, version: int) -> None:
        header = torch.tensor([op, version, len(self.buckets)], dtype=torch.int64)
        dist.broadcast(header.to(self._ctrl_device), src=0, group=self._ctrl)

    def _broadcast_buckets(self, tensors: dict[str, torch.Tensor]) -> None:
        # Two buffers: bucket i is flattened while bucket i-1 is on the wire. One broadcast at
        # a time: a second in flight only splits the same link (and, on few cores, the CPU).
        in_flight: dist.Work | None = None
        for i, bucket in enumerate(self.buckets):
            flat = self._flat(bucket, tensors, i % 2)
            if in_flight is not None:
                in_flight.wait()
            in_flight = dist.broadcast(flat, src=0, async_op=True)
        if in_flight is not None:
            in_flight.wait()

    def _flat(self, bucket, tensors: dict[str, torch.Tensor], slot: int) -> torch.Tensor:
        if len(bucket.specs) == 1:
            # A lone tensor (often one larger than a bucket) goes out as is when it can.
            tensor = tensors[bucket.specs[0].name].detach()
            if tensor.is_contiguous() and tensor.device == self.device:
                return tensor.reshape(-1)
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < bucket.nbytes:
            size = max([bucket.nbytes, *(b.nbytes for b in self.buckets if len(b.specs) > 1)])
            buffer = self._buffers[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        flat = flat_view(buffer, bucket)
        flatten_into(bucket, tensors, flat)
        return flat

    def _forget_record(self) -> None:
        # Remove the rendezvous record only while it is still ours (a restarted trainer may
        # have published a newer one).
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(self.store.read_bytes(self.path)).get("nonce") == self._nonce:
                self.store.delete(self.path)


class BroadcastReceiver:
    """One rank (1..world_size-1) of the group; stages updates in a thread for `take()`.

    `timeout_s` bounds finding the rendezvous record and joining the group. Between updates a
    receiver waits for as long as the trainer takes, up to `idle_timeout_s` (gloo and NCCL fail
    a collective that waits longer than the group's timeout); a sender that dies closes its
    connections, which fails the wait at once on gloo.
    """

    def __init__(
        self,
        store: ObjectStore,
        group: str,
        rank: int,
        specs: list[TensorSpec],
        bucket_bytes: int = 64 << 20,
        timeout_s: float = 300.0,
        idle_timeout_s: float = 7 * 24 * 3600.0,
    ) -> None:
        if rank < 1:
            raise ValueError(f"receiver ranks start at 1 (rank 0 is the sender), got {rank}")
        self.store = store
        self.group = group
        self.path = rendezvous_path(group)
        self.rank = rank
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
        self._ctrl: Any = None
        self._ctrl_device = self.device

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        record, tcp = self._connect(deadline)
        backend = record["backend"]
        self.device = _device_for(backend)
        # CUDA's caching allocator already reuses freed staging; a held free set would only
        # take GPU memory from the engine.
        self._pool = StagingPool(keep=0 if self.device.type == "cuda" else 1)
        tcp.set_timeout(timedelta(seconds=max(1.0, deadline - time.monotonic())))
        idle = timedelta(seconds=self.idle_timeout_s)
        try:
            dist.init_process_group(
                backend,
                store=tcp,
                rank=self.rank,
                world_size=int(record["world_size"]),
                # The default group carries the wait for the next update unless headers have
                # a group of their own (NCCL).
                timeout=idle if backend == "gloo" else timedelta(seconds=self.timeout_s),
            )
        except Exception as err:
            raise TimeoutError(
                f"weight sync group {self.group!r}: rank {self.rank} could not join the group "
                f"at {record['addr']}:{record['port']} ({type(err).__name__}: {err})"
            ) from err
        self._joined = True
        self._ctrl, self._ctrl_device = _control_group(backend, idle)
        rows = _layout_check(
            self.fingerprint, len(self.specs), self.bucket_bytes, self._ctrl, self._ctrl_device
        )
        if any(row != rows[0] for row in rows):
            dist.destroy_process_group()
            self._joined = False
            raise LayoutMismatch(self._mismatch_message(record, rows))

    def start(self) -> None:
        """Receive updates in a daemon thread until STOP."""
        if not self._joined:
            raise RuntimeError(f"weight sync group {self.group!r}: start() before init()")
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"weight-sync-{self.group}-r{self.rank}", daemon=True
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
            dist.destroy_process_group()
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

    # ------------------------------------------------------------------ internals
    def _connect(self, deadline: float) -> tuple[dict, dist.TCPStore]:
        """Read the rendezvous record and connect to its store; a record left by a dead sender
        is read again until a live one appears or the deadline passes."""
        last_error = ""
        while True:
            record = self._read_record(deadline)
            if not 1 <= self.rank < int(record["world_size"]):
                raise ValueError(
                    f"weight sync group {self.group!r} has world_size {record['world_size']}: "
                    f"receiver ranks are 1..{int(record['world_size']) - 1}, got {self.rank}"
                )
            remaining = deadline - time.monotonic()
            try:
                tcp = dist.TCPStore(
                    record["addr"],
                    int(record["port"]),
                    int(record["world_size"]),
                    is_master=False,
                    timeout=timedelta(seconds=max(1.0, min(remaining, _CONNECT_TRY_S))),
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
            time.sleep(_POLL_S)

    def _read_record(self, deadline: float) -> dict:
        while True:
            try:
                return json.loads(self.store.read_bytes(self.path))
            except FileNotFoundError:
                pass
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"weight sync group {self.group!r}: no rendezvous record at "
                    f"{self.store.url(self.path)} after {self.timeout_s:.0f}s; is the trainer "
                    "(the sender) running and using the same queue root and group name?"
                )
            time.sleep(_POLL_S)

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
            f"({'; '.join(what) or _describe_row(rows[bad[0]])}); 'here' is rank {self.rank}, "
            "'there' the sender; build the trainer's architecture and use its bucket_bytes"
        )

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            while True:
                op, version, n_buckets = self._recv_header()
                if op == STOP:
                    self._slot.stop()
                    return
                self._expect_header(op, UPDATE, n_buckets)
                tensors = self._recv_buckets()
                end, end_version, n_buckets = self._recv_header()
                self._expect_header(end, END, n_buckets)
                if end_version != version:
                    raise RuntimeError(
                        f"weight sync group {self.group!r}: update {version} ended as "
                        f"{end_version} (protocol error)"
                    )
                replaced = self._slot.put((version, tensors))
                if replaced is not None:  # never taken: its staging is free
                    self._pool.release(replaced[1])
        except BaseException as err:  # surfaced to the engine loop by take()/wait()
            self._slot.fail(err)

    def _recv_header(self) -> tuple[int, int, int]:
        header = torch.empty(3, dtype=torch.int64, device=self._ctrl_device)
        dist.broadcast(header, src=0, group=self._ctrl)
        op, version, n_buckets = header.tolist()
        return op, version, n_buckets

    def _expect_header(self, op: int, expected: int, n_buckets: int) -> None:
        if op != expected or n_buckets != len(self.buckets):
            raise RuntimeError(
                f"weight sync group {self.group!r}: expected a {_OPS[expected]} header for "
                f"{len(self.buckets)} buckets, got op {_OPS.get(op, op)} for {n_buckets} "
                "(protocol error)"
            )

    def _recv_buckets(self) -> UpdateTensors:
        # Staging is fresh or given back (StagingPool): what take() handed out and was not
        # released is never written again.
        flats = self._pool.acquire(self._new_staging)
        works = [dist.broadcast(flat, src=0, async_op=True) for flat in flats[:2]]
        for i in range(len(flats)):
            works[i].wait()
            if i + 2 < len(flats):
                works.append(dist.broadcast(flats[i + 2], src=0, async_op=True))
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
