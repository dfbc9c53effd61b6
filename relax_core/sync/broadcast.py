"""Weight sync over a torch.distributed broadcast group: trainer (rank 0) -> rollout engines.

Parts:
- rendezvous: the sender opens a TCPStore on a free port of `host` and publishes its address in
  `control/rendezvous/{group}` on the run's object store (state "forming") with the members of
  this generation by name and rank; receivers poll that record and join at their rank. All
  ranks then exchange a layout check (fingerprint, tensor count, bucket size), so a mismatched
  receiver fails init on both sides with a message instead of corrupting weights; then the
  record says "formed".
- membership: the sender's `members` is a list of receiver names or a function returning the
  wanted ones (an elastic rollout pool). The first generation waits for all of them; a later one
  takes the wanted members that were in the last one or wait to join now, so a member still
  starting never stalls the trainer: it joins the next generation, formed as soon as it waits.
- recovery: with gloo, a member that dies fails every later op of every other member. The sender
  then `reform`s: a new generation (new store, new nonce) that the surviving receivers rejoin and
  a restarted receiver joins; a restarted sender forms one the same way. Receivers join only a
  record that is "forming", names them, and is not the generation they already left. A member
  no longer wanted (drained) or a wanted one waiting to join makes `needs_reform` true.
- wire format: every message starts with an int64 header [op, version, n_buckets]. An update is
  UPDATE header (`pause`), one broadcast per bucket (`send`), END header (`resume`); STOP ends
  the receivers' loop (`destroy`).
- `BroadcastSender.send` flattens bucket i+1 while bucket i is on the wire (two buffers).
- `BroadcastReceiver` (broadcast_receiver.py) runs a thread that receives each update into
  staging buffers of its own (fresh, or given back through `release`) and hands the complete
  update to the engine loop through an `UpdateSlot` (see apply.py).

Backend "gloo" moves CPU tensors, "nccl" CUDA tensors of the current device; the code is the same
(with NCCL, headers and the layout check go over a second, gloo group).
The groups are groups of their own on the generation's TCP store (named by its nonce), never
torch's default group: a trainer over several GPUs holds that one for itself. Gloo picks its
network interface from the hostname (set GLOO_SOCKET_IFNAME to choose one).
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relax_core.queue.store import ObjectStore
from relax_core.sync.broadcast_group import (
    END,
    FORMED,
    FORMING,
    STOP,
    UPDATE,
    Members,
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
    NamedTensors,
    TensorSpec,
    WeightSource,
    check_tensors,
    flat_view,
    flatten_into,
    layout_fingerprint,
    layout_to_json,
    plan_buckets,
    replayable,
    stream_buckets,
)


class BroadcastSender:
    """Rank 0 of the group: pushes the trainer's named parameters to its member receivers.

    `members` names the receivers (ranks 1.. in that order), or is a function returning the
    names wanted now; the group then follows it generation by generation (see the module doc).
    """

    def __init__(
        self,
        store: ObjectStore,
        group: str,
        members: Members,
        specs: list[TensorSpec],
        bucket_bytes: int = 64 << 20,
        backend: str = "gloo",
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
    ) -> None:
        self.store = store
        self.group = group
        self.path = rendezvous_path(group)
        self._wanted = members if callable(members) else (lambda fixed=tuple(members): fixed)
        self.wanted()  # a bad name or an empty set fails here, not at the first update
        self.members: list[str] = []
        """The receivers of the current generation, rank 1 first."""
        self.specs = list(specs)
        self.bucket_bytes = bucket_bytes
        self.buckets = plan_buckets(self.specs, bucket_bytes)
        self.fingerprint = layout_fingerprint(self.specs)
        self.backend = backend
        self.host = host
        self.timeout_s = timeout_s
        self.device = device_for(backend)
        self._nonce = ""
        self._state = "new"  # new -> idle <-> paused -> sent -> idle ... -> destroyed
        self._version: int | None = None
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._pg: Any = None
        self._ctrl: Any = None
        self._ctrl_device = self.device
        self.generation = 0
        self._formed_at = float("inf")

    @property
    def world_size(self) -> int:
        return 1 + len(self.members)

    def wanted(self) -> list[str]:
        """The receivers wanted now, checked."""
        names = [check_member(n) for n in self._wanted()]
        if not names:
            raise ValueError(f"weight sync group {self.group!r} has no receivers to send to")
        if len(set(names)) != len(names):
            raise ValueError(f"weight sync group {self.group!r}: member names repeat: {names}")
        return names

    def waiting(self, among: list[str]) -> dict[str, float]:
        """Receivers of `among` waiting to join a group now: name -> when their wait began.

        Only their markers are read: a drained engine's marker stays behind, and reading every
        one would make each update's check grow with the engines a run ever removed."""
        prefix = waiting_path(self.group)
        found = {}
        for name in set(self.store.list_dir(prefix)) & set(among):
            with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
                found[name] = float(json.loads(self.store.read_bytes(f"{prefix}/{name}"))["since"])
        return found

    def _next_members(self) -> list[str]:
        wanted = self.wanted()
        if self.generation == 0 or not self.members:
            return wanted  # a (re)started sender waits for every member
        # Later generations take who was there and who waits now; a member still starting
        # joins the next one (formed when it waits) instead of stalling this one.
        waiting = self.waiting(wanted)
        chosen = [n for n in wanted if n in self.members or n in waiting]
        return chosen or wanted

    # ------------------------------------------------------------------ lifecycle
    def init(self) -> None:
        if self._state != "new":
            raise RuntimeError(f"weight sync group {self.group!r}: init() was already called")
        timeout = timedelta(seconds=self.timeout_s)
        self.members = self._next_members()
        tcp = dist.TCPStore(
            self.host, 0, self.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        self._nonce = uuid.uuid4().hex
        record = {
            "addr": self.host,
            "port": tcp.port,
            "world_size": self.world_size,
            "members": {name: rank for rank, name in enumerate(self.members, start=1)},
            "backend": self.backend,
            "fingerprint": self.fingerprint,
            "bucket_bytes": self.bucket_bytes,
            "layout": layout_to_json(self.specs),
            "nonce": self._nonce,
            "generation": self.generation,
            "state": FORMING,
            "time": time.time(),
        }
        self.store.write_replace(self.path, json.dumps(record).encode())
        try:
            self._pg, self._ctrl, self._ctrl_device = sync_groups(
                self.backend, tcp, 0, self.world_size, self._nonce, timeout, timeout
            )
        except Exception as err:
            self._forget_record()
            raise TimeoutError(
                f"weight sync group {self.group!r}: not all of its receivers "
                f"{', '.join(self.members)} joined within {self.timeout_s:.0f}s (rendezvous at "
                f"{self.store.url(self.path)}; {type(err).__name__}: {err})"
            ) from err
        rows = layout_check(
            self.fingerprint, len(self.specs), self.bucket_bytes, self._ctrl, self._ctrl_device
        )
        bad = [rank for rank, row in enumerate(rows) if row != rows[0]]
        if bad:
            self._leave_groups()
            self._forget_record()
            self._state = "destroyed"
            names = [self.members[rank - 1] for rank in bad]
            raise LayoutMismatch(
                f"weight sync group {self.group!r}: receiver(s) {names} hold another weight "
                f"layout than the sender (sender: {describe_layout_row(rows[0])}; {names[0]}: "
                f"{describe_layout_row(rows[bad[0]])}); every receiver must build the trainer's "
                "architecture and use its bucket_bytes"
            )
        record["state"] = FORMED
        self._formed_at = time.time()
        self.store.write_replace(self.path, json.dumps(record).encode())
        self._state = "idle"

    def needs_reform(self) -> bool:
        """Whether the next update must go to a new generation: a member is no longer wanted
        (drained), a wanted receiver outside the group waits to join (a new engine), or a
        member began waiting after this generation formed (it broke, or it restarted)."""
        wanted = self.wanted()
        if any(name not in wanted for name in self.members):
            return True
        for name, since in self.waiting(wanted).items():
            if name not in self.members or since > self._formed_at:
                return True
        return False

    def push_or_reform(self, weights: WeightSource, version: int) -> bool:
        """`push`, forming a new generation first when a receiver waits for one, or when the
        push fails because a member died (then the whole update goes again, read anew from
        `weights` when it is a function such as a backend's `named_weights`). True if
        reformed."""
        tensors = replayable(weights)
        reformed = False
        if self.needs_reform():
            self.reform()
            reformed = True
        try:
            self.push(tensors(), version)
            return reformed
        except (ProtocolError, ValueError):
            raise
        except RuntimeError:  # gloo: a peer's connection closed or reset mid-update
            pass
        # Outside the handler: its traceback holds the failed work, and through it the old
        # group, whose connections must close for the survivors to notice and rejoin.
        self.reform()
        self.push(tensors(), version)
        return True

    def reform(self) -> None:
        """Leave a broken group (a member died: gloo fails every op of a group with a dead
        peer) and form the next generation; blocks until every rank joined it again (surviving
        receivers rejoin on their own, a restarted one joins as it starts)."""
        with contextlib.suppress(Exception):
            self._leave_groups()
        self._buffers = [None, None]
        gc.collect()  # drop the last references to the old group's connections now
        self._state = "new"
        self.generation += 1
        self.init()

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
            self._leave_groups()
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
        """Broadcast every bucket as the tensors arrive (buckets.stream_buckets); a list with a
        missing or misfit tensor is refused before anything is sent."""
        self._expect("paused", "send()")
        if self._version is not None and version != self._version:
            raise ValueError(f"send(version={version}) after pause(version={self._version})")
        stream = stream_buckets(self.specs, self.buckets, named_tensors)
        if self._version is None:
            self._header(UPDATE, version)
            self._version = version
        with torch.no_grad():
            self._broadcast_buckets(stream)
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
        """pause -> send -> resume: one complete update, streamed bucket by bucket."""
        if not isinstance(named_tensors, Iterator):
            check_tensors(self.specs, named_tensors)  # a misfit list sends not even a header
        self.pause(version)
        self.send(named_tensors, version)
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

    def _broadcast_buckets(self, stream) -> None:
        # Two buffers: bucket i is flattened while bucket i-1 is on the wire. One broadcast at
        # a time: a second in flight only splits the same link (and, on few cores, the CPU).
        # closing: a failed broadcast still reads the rest of the stream (buckets.finish).
        in_flight: dist.Work | None = None
        with contextlib.closing(stream):
            for i, bucket, tensors in stream:
                flat = self._flat(bucket, tensors, i % 2)
                if in_flight is not None:
                    in_flight.wait()
                in_flight = dist.broadcast(flat, src=0, async_op=True, group=self._pg)
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

    def _leave_groups(self) -> None:
        leave_groups(self._ctrl, self._pg)
        self._pg = self._ctrl = None

    def _forget_record(self) -> None:
        # Remove the rendezvous record only while it is still ours (a restarted trainer may
        # have published a newer one).
        with contextlib.suppress(FileNotFoundError, ValueError):
            if json.loads(self.store.read_bytes(self.path)).get("nonce") == self._nonce:
                self.store.delete(self.path)
