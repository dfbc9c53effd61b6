"""Queue overhead: TransferQueue put+read vs a raw fsspec write+read of the same Arrow bytes.

Each op moves one rollout batch: 4 whole groups of 8 responses (prompt ~20 tokens, response ~64
tokens with rollout/ref/old log-probs and advantages). Per iteration:
  queue  TransferQueue.put (validate, encode, payload + commit record) then .read (record,
         payload, decode, validate)
  raw    encode_table + fs.pipe_file to one path, then fs.cat_file + Arrow IPC decode
on the same filesystem, zstd-compressed where the queue compresses (object storage) and not where
it does not (local disk). The two run interleaved (the order swaps every iteration so neither
always runs on a warmer cache), each with a fresh run_id / prefix.

Backends: local disk (a temp dir; the queue with durable=False, since pipe_file does not fsync
either, plus an informational durable=True row) and SeaweedFS (`weed mini` on loopback, started
by tests/s3servers.py).

Rounds (`--rounds`, 3 by default) repeat the whole measurement, the backends in turn; the process
and the SeaweedFS server it starts are pinned to `--cpus`, with `--threads` for Arrow's pool.

    python bench/queue.py [--n 200] [--rounds 3] [--cpus 0,1] [--threads 1] [--profile]

Prints each round's table, then per backend the queue/raw ratio (median queue put+read over
median raw put+read) as median (min-max) over the rounds; last line `headline: queue_overhead = X`,
the larger of the two like-for-like backends' medians.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, this file's directory leads sys.path and the file itself would shadow the
# standard library's `queue` (which s3fs, urllib3 and concurrent.futures import).
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import cProfile
import pstats
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
from fsspec.implementations.local import LocalFileSystem

from bench.common import add_pin_args, cpu_set, median_range
from relax_core.queue import TransferQueue, rows_to_table
from relax_core.queue.ipc import encode_table
from tests.s3servers import start_seaweedfs

GROUP_SIZE = 8
PROMPT_TOKENS = 20
RESPONSE_TOKENS = 64


def rollout_table(rng: np.random.Generator, n_groups: int, step: int) -> pa.Table:
    """`n_groups` whole groups as the rollout stage writes them, plus ref/old log-probs."""
    rows = []
    for g in range(n_groups):
        gid = f"s{step}-g{g}"
        prompt = rng.integers(0, 50_000, PROMPT_TOKENS + int(rng.integers(-4, 5))).tolist()
        for i in range(GROUP_SIZE):
            n = RESPONSE_TOKENS + int(rng.integers(-16, 17))
            logprobs = (-rng.exponential(1.0, n)).astype(np.float32)
            reward = float(rng.integers(0, 2))
            rows.append(
                {
                    "uid": f"{gid}-{i}",
                    "group_id": gid,
                    "prompt_index": step * n_groups + g,
                    "epoch": 0,
                    "prompt_ids": prompt,
                    "response_ids": rng.integers(0, 50_000, n).tolist(),
                    "loss_mask": [1] * n,
                    "rollout_logprobs": logprobs.tolist(),
                    "reward": reward,
                    "reward_info": {"correct": bool(reward)},
                    "finish_reason": "stop",
                    "behaviour_version_min": step,
                    "behaviour_version_max": step,
                    "turns": 1,
                    "ref_logprobs": (logprobs + rng.normal(0, 0.05, n)).tolist(),
                    "old_logprobs": logprobs.tolist(),
                    "advantages": [reward - 0.5] * n,
                }
            )
    return rows_to_table(rows)


@dataclass
class Backend:
    """One storage location, reached both through the queue and through raw fsspec."""

    name: str
    root: str
    """Queue root (a directory or s3:// URL); the raw baseline writes under it too."""
    storage_options: dict[str, Any]
    durable: bool = True
    headline: bool = True
    """Whether this row is like-for-like and counts toward the headline."""


class Raw:
    """The least a data bus has to do: encode, write one object, read it back, decode. It
    encodes as the queue does on the same backend: zstd for object storage, none on local disk
    (relax_core/queue/ipc.py), so both sides move the same bytes."""

    def __init__(self, backend: Backend) -> None:
        self.fs, root = fsspec.core.url_to_fs(backend.root, **backend.storage_options)
        local = isinstance(self.fs, LocalFileSystem)  # the queue's own test (ObjectStore.is_local)
        self.compress = not local
        self.prefix = f"{root.rstrip('/')}/raw-{uuid.uuid4().hex[:8]}"
        if local:
            os.makedirs(self.prefix, exist_ok=True)
        self.i = 0

    def put(self, table: pa.Table) -> str:
        path = f"{self.prefix}/{self.i:08d}.arrow"
        self.i += 1
        self.fs.pipe_file(path, encode_table(table, compress=self.compress))
        return path

    def read(self, path: str) -> pa.Table:
        return pa.ipc.open_file(pa.BufferReader(self.fs.cat_file(path))).read_all()


class Queue:
    """TransferQueue's put and read, as a stage writer and a consumer use them."""

    def __init__(self, backend: Backend) -> None:
        run_id = f"bench-{uuid.uuid4().hex[:8]}"
        self.q = TransferQueue(
            backend.root, run_id, backend.storage_options, durable=backend.durable
        )
        self.step = 0

    def put(self, table: pa.Table) -> int:
        self.step += 1
        return self.q.put("rollout", table, {"policy_version": self.step})

    def read(self, seq: int) -> pa.Table:
        return self.q.read("rollout", seq)


def one(sut: Raw | Queue, table: pa.Table) -> tuple[float, float]:
    t0 = time.perf_counter()
    key = sut.put(table)
    t1 = time.perf_counter()
    got = sut.read(key)
    t2 = time.perf_counter()
    if got.num_rows != table.num_rows:
        raise AssertionError(f"read back {got.num_rows} rows, wrote {table.num_rows}")
    return t1 - t0, t2 - t1


def measure(backend: Backend, tables: list[pa.Table], n: int, warmup: int) -> dict[str, Any]:
    queue, raw = Queue(backend), Raw(backend)
    times: dict[str, list[tuple[float, float]]] = {"queue": [], "raw": []}
    for i in range(warmup + n):
        table = tables[i % len(tables)]
        order = [("queue", queue), ("raw", raw)]
        if i % 2:
            order.reverse()
        for name, sut in order:
            t = one(sut, table)
            if i >= warmup:
                times[name].append(t)
    out: dict[str, Any] = {"backend": backend.name, "headline": backend.headline}
    for name, ts in times.items():
        out[f"{name}_put"] = statistics.median(p for p, _ in ts)
        out[f"{name}_read"] = statistics.median(r for _, r in ts)
        out[f"{name}_total"] = statistics.median(p + r for p, r in ts)
    return out


def profile(backend: Backend, tables: list[pa.Table], n: int) -> None:
    """cProfile of `n` queue put+read iterations (after a short warm-up), top by cumulative time."""
    queue = Queue(backend)
    for table in tables[:3]:
        one(queue, table)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        one(queue, tables[i % len(tables)])
    prof.disable()
    print(f"\n--- cProfile, queue put+read x{n} on {backend.name} (cumulative) ---")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(30)


def print_table(rows: list[dict[str, Any]], n: int, groups: int, table: pa.Table) -> None:
    print(f"{n} put+read per side, interleaved; {groups} groups x {GROUP_SIZE} rows per put,")
    zstd, plain = len(encode_table(table)), len(encode_table(table, compress=False))
    print(
        f"{zstd / 1024:.1f} KiB Arrow IPC with zstd (object storage), {plain / 1024:.1f} KiB "
        "without (local disk) per payload; medians in ms"
    )
    head = ["backend", "queue put", "raw put", "queue read", "raw read", "queue p+r", "raw p+r"]
    print("| " + " | ".join(head + ["queue/raw"]) + " |")
    print("|" + "---|" * (len(head) + 1))
    for r in rows:
        cells = [r["backend"] + ("" if r["headline"] else " (info)")]
        for key in ("put", "read", "total"):
            cells += [f"{r[f'queue_{key}'] * 1e3:.2f}", f"{r[f'raw_{key}'] * 1e3:.2f}"]
        cells.append(f"{r['queue_total'] / r['raw_total']:.2f}")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="timed put+read per side and backend")
    parser.add_argument("--warmup", type=int, default=10, help="untimed iterations first")
    parser.add_argument("--groups", type=int, default=4, help="whole groups of 8 rows per put")
    parser.add_argument("--rounds", type=int, default=3, help="whole measurements, one per round")
    parser.add_argument("--profile", action="store_true", help="cProfile the queue afterwards")
    add_pin_args(parser, threads=1)
    args = parser.parse_args()
    cpus = cpu_set(args.cpus)
    os.sched_setaffinity(0, cpus)  # the SeaweedFS server started below inherits the set
    pa.set_cpu_count(args.threads)
    print(f"CPUs {cpus}, {args.threads} Arrow threads, {args.rounds} rounds", flush=True)

    rng = np.random.default_rng(0)
    tables = [rollout_table(rng, args.groups, step) for step in range(16)]
    work = tempfile.mkdtemp(prefix="relax-bench-queue-")
    stops: list[Callable[[], None]] = [lambda: shutil.rmtree(work, ignore_errors=True)]
    try:
        weed = start_seaweedfs(os.path.join(work, "seaweedfs"))
        stops.insert(0, weed.stop)
        local = os.path.join(work, "local")
        os.makedirs(local)
        backends = [
            Backend("local", local, {}, durable=False),
            Backend("local, durable=True", local, {}, durable=True, headline=False),
            Backend("seaweedfs", f"s3://{weed.bucket}/bench", weed.storage_options()),
        ]
        ratios: dict[str, list[float]] = {b.name: [] for b in backends}
        for i in range(args.rounds):
            rows = [measure(b, tables, args.n, args.warmup) for b in backends]
            print(f"round {i}:")
            print_table(rows, args.n, args.groups, tables[0])
            for r in rows:
                ratios[r["backend"]].append(r["queue_total"] / r["raw_total"])
        if args.profile:
            for b in backends:
                if b.headline:
                    profile(b, tables, args.n)
    finally:
        for stop in stops:
            stop()
    for b in backends:
        print(f"{b.name}: queue/raw per round, median (min-max) {median_range(ratios[b.name], 2)}")
    worst = max(statistics.median(ratios[b.name]) for b in backends if b.headline)
    print(f"headline: queue_overhead = {worst:.2f}")


if __name__ == "__main__":
    main()
