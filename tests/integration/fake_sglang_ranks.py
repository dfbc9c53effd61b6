"""The tensor-parallel ranks of a stand-in server launched with `--tp-size N`.

SGLang runs one scheduler process per TP rank, and each joins the trainer's weight group itself:
rank = rank_offset + tp_rank (srt/model_executor/model_runner_components/weight_updater.py,
WeightUpdater.init_weights_update_group), and every rank receives every broadcast. The server's
answer merges all ranks' (FanOutCommunicator.merge_results): one failing rank fails the call.
Here ranks 1..N-1 are child processes (tp rank 0 is the server process itself): a wrong rank
offset or world size makes the rendezvous fail or time out, as it does on GPUs.

Each child answers a receive with the sha256 of the bytes it got, so the server can check that
every rank received the same weights.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
from typing import Any

import torch
import torch.distributed as dist

from relax_core.sync.buckets import dtype_of
from relax_core.sync.process_group import join_weight_group, leave_weight_group


def receive(group: Any, dtypes: list[str], shapes: list[list[int]], flat: bool) -> list:
    """One update's tensors off the group: a flat uint8 broadcast of them back to back (SGLang's
    FlattenedTensorBucket: each tensor's byte offset must be a multiple of its item size, and an
    empty bucket is an error), else one broadcast per tensor."""
    empties = [torch.empty(s, dtype=dtype_of(d)) for d, s in zip(dtypes, shapes, strict=True)]
    if not flat:
        for t in empties:
            dist.broadcast(t, src=0, group=group)
        return empties
    if not empties:
        raise ValueError("Cannot create empty tensor bucket")
    offset = 0
    for t in empties:
        if offset % t.element_size():
            raise ValueError(f"Unaligned received tensor: byte offset {offset}, {t.dtype}")
        offset += t.nbytes
    buffer = torch.empty(offset, dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=group)
    offset = 0
    for t in empties:
        t.view(-1).view(torch.uint8).copy_(buffer[offset : offset + t.nbytes])
        offset += t.nbytes
    return empties


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rank_main(conn: Any, tp_rank: int, servers_ends: list[Any]) -> None:
    # A forked child holds copies of the server's ends of every pipe made so far; with them open
    # it would never see the EOF that says the server died, and would outlive it (a SIGKILLed
    # server's daemon children are not stopped for it).
    for end in servers_ends:
        end.close()
    torch.set_num_threads(1)
    groups: dict[str, Any] = {}
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):  # the server died: so does its rank
            return
        try:
            if op == "init":
                backend, address, port, world, offset, name, timeout = args
                rank = offset + tp_rank
                groups[name] = join_weight_group(backend, address, port, world, rank, name, timeout)
                conn.send(("ok", None))
            elif op == "receive":
                name, dtypes, shapes, flat = args
                conn.send(("ok", digest(receive(groups[name], dtypes, shapes, flat))))
            elif op == "destroy":
                group = groups.pop(args[0], None)
                if group is not None:
                    leave_weight_group(group)
                conn.send(("ok", None))
        except Exception as err:  # noqa: BLE001 - reported to the server, which answers it
            conn.send(("error", f"tp rank {tp_rank}: {type(err).__name__}: {err}"))


class OtherRanks:
    """TP ranks 1..tp_size-1, each a process; `start` sends every rank an op, `results` waits
    for their answers (the server does its own rank's part in between)."""

    def __init__(self, tp_size: int) -> None:
        ctx = mp.get_context("fork")  # before the server starts any thread
        self.conns = []
        for r in range(1, tp_size):
            parent, child = ctx.Pipe()
            ctx.Process(
                target=_rank_main, args=(child, r, [*self.conns, parent]), daemon=True
            ).start()
            child.close()  # the rank's end lives in the rank
            self.conns.append(parent)

    def start(self, op: str, *args: Any) -> None:
        for conn in self.conns:
            conn.send((op, *args))

    def results(self) -> list[Any]:
        """Every rank's answer; RuntimeError naming the first rank that failed."""
        answers = [conn.recv() for conn in self.conns]
        for status, value in answers:
            if status != "ok":
                raise RuntimeError(value)
        return [value for _, value in answers]
