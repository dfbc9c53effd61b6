"""A trainer over several GPUs: one process per GPU (torchrun), rank 0 leading.

Rank 0 is the trainer service (queue, MLflow, checkpoints' state, weight sync to the engines).
Ranks 1.. hold their part of the sharded policy (FSDP2, Megatron) and do what rank 0 does to it,
in the same order, told over a control channel (a gloo group beside the backend's own group, so
it carries bytes whatever the backend's device):

    TRAIN  the step batch (Arrow IPC) and train_on_table's arguments (JSON): every rank builds
           the same micro-batches and the same loss; the backend splits the work between ranks
    WEIGHTS  every rank gathers the full weights while rank 0 sends them to the engines
    SAVE   a checkpoint directory: every rank writes its shards (rank 0 the HF files)
    STOP   the run is over

Nothing is pickled: tables go as Arrow, arguments as JSON. A rank that dies takes torchrun's
whole group down, and the supervisor (or Flyte's retry) restarts the trainer from its newest
checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pyarrow as pa
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

TRAIN, WEIGHTS, SAVE, STOP = "train", "weights", "save", "stop"


class Channel:
    """Rank 0 broadcasts (op, JSON arguments, optional Arrow table) to every rank."""

    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo")
        self.rank = dist.get_rank()

    def send(self, op: str, args: dict[str, Any] | None = None, table: pa.Table | None = None):
        header = json.dumps({"op": op, "args": args or {}}).encode()
        self._bytes(header)
        self._bytes(_table_bytes(table) if table is not None else b"")

    def receive(self) -> tuple[str, dict[str, Any], pa.Table | None]:
        header = json.loads(self._bytes(None))
        raw = self._bytes(None)
        table = pa.ipc.open_stream(raw).read_all() if raw else None
        return header["op"], header["args"], table

    def _bytes(self, data: bytes | None) -> bytes:
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(int(size), dtype=torch.uint8)
        )
        if int(size):
            dist.broadcast(buf, src=0, group=self.group)
        return bytes(buf.numpy()) if data is None else data


def _table_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


class LeaderBackend:
    """Rank 0's backend: the sharded backend, telling the other ranks before each collective.
    Anything else (hooks, attributes) is the inner backend's."""

    def __init__(self, inner: Any, channel: Channel) -> None:
        self.inner, self.channel = inner, channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in ("inner", "channel"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def share_step(self, table: pa.Table, args: dict[str, Any]) -> None:
        """Called by train_on_table before it trains: the ranks train on the same batch."""
        self.channel.send(TRAIN, args, table)

    def train_step(self, micro_batches, loss_fn) -> dict[str, float]:
        return self.inner.train_step(micro_batches, loss_fn)

    def named_weights(self, **layout: Any) -> Iterator[tuple[str, torch.Tensor]]:
        """`layout` (Megatron's fused_experts) only changes how rank 0 names what it gathers,
        not the collectives, so the other ranks gather as always."""
        self.channel.send(WEIGHTS)
        yield from self.inner.named_weights(**layout)

    def save(self, directory: str) -> None:
        self.channel.send(SAVE, {"directory": directory})
        self.inner.save(directory)
        dist.barrier(group=self.channel.group)

    def load(self, directory: str) -> None:
        self.inner.load(directory)  # every rank loads at its start, before the channel is used

    def stop(self) -> None:
        self.channel.send(STOP)


def follow(backend: Any, channel: Channel, train: Callable[[Any, pa.Table, dict], Any]) -> int:
    """Ranks 1..: do what rank 0 announces until STOP; returns the steps trained."""
    steps = 0
    while True:
        op, args, table = channel.receive()
        if op == TRAIN:
            train(backend, table, args)
            steps += 1
        elif op == WEIGHTS:
            for _ in backend.named_weights():
                pass
        elif op == SAVE:
            backend.save(args["directory"])
            dist.barrier(group=channel.group)
        elif op == STOP:
            log.info("rank %d: stop after %d steps", channel.rank, steps)
            return steps
        else:
            raise ValueError(f"rank {channel.rank}: unknown trainer operation {op!r}")
