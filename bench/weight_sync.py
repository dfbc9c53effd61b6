"""Weight sync throughput: bucketed BroadcastSender.push vs one raw broadcast of the same bytes.

One sender (this process) and one receiver process, gloo on 127.0.0.1, ~256 MiB of float32
tensors shaped like a small LM (13 Qwen2-style layers, vocab 16384, hidden 640: 184 tensors).
Per bucket size, one session of the transport; in it, per round, alternating order:
  bucketed  BroadcastSender.push (UPDATE header, bucket i flattened while bucket i-1 is on the
            wire, END header); the receiver's thread stages the update and its main thread
            takes it and gives the staging back (`release`), as `apply_update` does
  raw       torch.distributed.broadcast of one preallocated flat tensor of the same byte count
            (on a second gloo group between the same two processes)
Each timing runs from a barrier to a barrier after the receiver has the data, so both include
the receiver's side. A third row times the sender's flatten alone (the copy that a raw
broadcast of an already-flat tensor does not make). Then the object-store transport on local
disk (durable writes): push, and a receiver's load of the committed version.

Both processes run pinned to one CPU set (`--cpus`; the receiver inherits it) with one torch
thread budget (`--threads`), as every headline's sides do (bench/common.py).

    python bench/weight_sync.py [--rounds 5] [--layers 13] [--buckets 64,16] [--cpus 0,1]
        [--threads 2]

Last line: `headline: bucketed_vs_raw = X`: per round, the raw broadcast's seconds over the
bucketed push's at the default 64 MiB bucket (1.0 = as fast as a raw broadcast); X is the median
over rounds, their values and range on the line before.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue` (imported by torch, s3fs and concurrent.futures): put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from bench.common import add_pin_args, cpu_set, median_range, pinned_env, print_headline
from relax_core.queue.store import ObjectStore
from relax_core.sync import (
    BroadcastReceiver,
    BroadcastSender,
    ObjectStoreReceiver,
    ObjectStoreSender,
    TensorSpec,
)
from relax_core.sync.buckets import flat_view, flatten_into
from relax_core.sync.process_group import group_on_store

MiB = 1 << 20
TIMEOUT = timedelta(seconds=120)


def make_raw_group(store: dist.TCPStore, rank: int, mib: int):
    """The raw broadcast's gloo group between the two processes, one per bucket session, on the
    sender's TCP store (the transport's own groups are private to it, as in a run)."""
    return group_on_store("gloo", store, rank, 2, f"bench-raw-{mib}", TIMEOUT)


def lm_specs(layers: int, hidden: int = 640, inter: int = 1728, vocab: int = 16384) -> list:
    kv, head = 128, 64
    specs = [TensorSpec("model.embed_tokens.weight", (vocab, hidden), "float32")]
    for i in range(layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (hidden,), "float32"),
            TensorSpec(p + "self_attn.q_proj.weight", (hidden, hidden), "float32"),
            TensorSpec(p + "self_attn.q_proj.bias", (hidden,), "float32"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv, hidden), "float32"),
            TensorSpec(p + "self_attn.k_proj.bias", (kv,), "float32"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv, hidden), "float32"),
            TensorSpec(p + "self_attn.v_proj.bias", (kv,), "float32"),
            TensorSpec(p + "self_attn.q_norm.weight", (head,), "float32"),
            TensorSpec(p + "self_attn.k_norm.weight", (head,), "float32"),
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, hidden), "float32"),
            TensorSpec(p + "post_attention_layernorm.weight", (hidden,), "float32"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, hidden), "float32"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, hidden), "float32"),
            TensorSpec(p + "mlp.down_proj.weight", (hidden, inter), "float32"),
        ]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "float32"))
    return specs


def schedule(rounds: int) -> list[str]:
    """What each round times, in order; both processes follow it."""
    out = []
    for r in range(rounds):
        out += ["bucketed", "raw"] if r % 2 == 0 else ["raw", "bucketed"]
    return out


# ---------------------------------------------------------------------- receiver process
def receive(args: argparse.Namespace) -> None:
    specs = lm_specs(args.layers)
    nbytes = sum(s.nbytes for s in specs)
    store = ObjectStore(args.root, durable=False)
    tcp = dist.TCPStore("127.0.0.1", args.raw_port, 2, is_master=False, timeout=TIMEOUT)
    for mib in args.buckets:
        receiver = BroadcastReceiver(store, f"bench{mib}", "r1", specs, bucket_bytes=mib * MiB)
        receiver.init()
        group = make_raw_group(tcp, 1, mib)
        receiver.start()
        raw = torch.empty(nbytes // 4, dtype=torch.float32)
        version = 0
        for item in schedule(args.rounds):
            dist.barrier(group=group)
            if item == "raw":
                dist.broadcast(raw, src=0, group=group)
            else:
                version += 1
                while not receiver.wait(1.0):
                    pass
                got = receiver.take()
                assert got is not None and got[0] == version, got and got[0]
                receiver.release(got)  # as apply_update(engine, got, receiver.release) does
                del got
            dist.barrier(group=group)
        while not receiver.stopped:
            receiver.wait(1.0)
        receiver.destroy()


# ---------------------------------------------------------------------- sender process
def _timed(fn, group) -> float:
    dist.barrier(group=group)
    start = time.perf_counter()
    fn()
    dist.barrier(group=group)
    return time.perf_counter() - start


def broadcast_session(args, store, tcp, specs, tensors, mib: int) -> dict[str, list[float]]:
    sender = BroadcastSender(store, f"bench{mib}", ["r1"], specs, bucket_bytes=mib * MiB)
    sender.init()
    group = make_raw_group(tcp, 0, mib)
    flat = torch.cat([t.reshape(-1) for _, t in tensors])
    times: dict[str, list[float]] = {"bucketed": [], "raw": []}
    version = 0
    for item in schedule(args.rounds):
        if item == "raw":
            times["raw"].append(_timed(lambda: dist.broadcast(flat, src=0, group=group), group))
        else:
            version += 1
            times["bucketed"].append(_timed(lambda v=version: sender.push(tensors, v), group))
    print(f"  bucket {mib} MiB: {len(sender.buckets)} buckets", flush=True)
    sender.destroy()
    # The copy push adds to what a raw broadcast does, timed alone between rounds' transfers.
    named = dict(tensors)
    buffer = torch.empty(max(b.nbytes for b in sender.buckets), dtype=torch.uint8)
    for _ in range(args.rounds):
        start = time.perf_counter()
        for bucket in sender.buckets:
            flatten_into(bucket, named, flat_view(buffer, bucket))
        times.setdefault("flatten", []).append(time.perf_counter() - start)
    return times


def object_store_session(args, specs, tensors) -> dict[str, list[float]]:
    root = tempfile.mkdtemp(prefix="weights-bench-")
    try:
        store = ObjectStore(root)  # durable: fsync per bucket file, as a run writes them
        sender = ObjectStoreSender(store, specs, bucket_bytes=64 * MiB, keep=2)
        sender.init()
        receiver = ObjectStoreReceiver(ObjectStore(root), specs)
        times: dict[str, list[float]] = {"write": [], "read": []}
        for version in range(1, args.rounds + 1):
            start = time.perf_counter()
            sender.push(tensors, version)
            times["write"].append(time.perf_counter() - start)
            start = time.perf_counter()
            assert receiver.poll_once()
            update = receiver.take()
            times["read"].append(time.perf_counter() - start)
            assert update is not None and update[0] == version
            del update
        return times
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=13)
    parser.add_argument(
        "--buckets", default="64,16", help="bucket sizes in MiB; the first one is the headline's"
    )
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender")
    parser.add_argument("--root", default="")
    parser.add_argument("--raw-port", type=int, default=0, help=argparse.SUPPRESS)
    add_pin_args(parser)
    args = parser.parse_args()
    args.buckets = [int(b) for b in args.buckets.split(",")]
    if args.role == "receiver":
        torch.set_num_threads(args.threads)
        receive(args)
        return
    cpus = cpu_set(args.cpus)
    os.sched_setaffinity(0, cpus)  # the receiver, started below, inherits the CPU set
    torch.set_num_threads(args.threads)

    specs = lm_specs(args.layers)
    nbytes = sum(s.nbytes for s in specs)
    gen = torch.Generator().manual_seed(0)
    tensors = [(s.name, torch.randn(s.shape, generator=gen)) for s in specs]
    print(
        f"{len(specs)} float32 tensors, {nbytes / MiB:.1f} MiB; torch {torch.__version__}, "
        f"both processes on CPUs {cpus} with {args.threads} threads, {args.rounds} rounds",
        flush=True,
    )
    root = tempfile.mkdtemp(prefix="weight-sync-bench-")
    # The raw broadcast's rendezvous: a TCP store this process hosts for the whole run.
    tcp = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    cmd = [sys.executable, os.path.abspath(__file__), "--role", "receiver", "--root", root]
    cmd += ["--raw-port", str(tcp.port)]
    cmd += ["--rounds", str(args.rounds), "--layers", str(args.layers)]
    cmd += ["--buckets", ",".join(map(str, args.buckets)), "--threads", str(args.threads)]
    proc = subprocess.Popen(cmd, cwd=REPO, env=pinned_env(args.threads))
    try:
        store = ObjectStore(root, durable=False)
        sessions = {
            mib: broadcast_session(args, store, tcp, specs, tensors, mib) for mib in args.buckets
        }
        if proc.wait(timeout=120) != 0:
            raise SystemExit(f"receiver failed with status {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)
    disk = object_store_session(args, specs, tensors)

    def rate(seconds: float) -> str:
        return f"{nbytes / seconds / (1 << 30):.2f}"

    print()
    print(
        "| transport | bucket | median s | GiB/s | raw median s (same session) | raw / push per round |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    ratios = {}
    for mib, times in sessions.items():
        b, r = statistics.median(times["bucketed"]), statistics.median(times["raw"])
        ratios[mib] = [
            raw / pushed for raw, pushed in zip(times["raw"], times["bucketed"], strict=True)
        ]
        print(
            f"| broadcast push (gloo) | {mib} MiB | {b:.3f} | {rate(b)} | {r:.3f} | "
            f"{median_range(ratios[mib], 2)} |"
        )
        print(f"| raw broadcast (gloo) | one flat tensor | {r:.3f} | {rate(r)} | | 1.00 |")
        f = statistics.median(times["flatten"])
        print(f"| flatten only (sender, no transfer) | {mib} MiB | {f:.3f} | {rate(f)} | | |")
    for what in ("write", "read"):
        m = statistics.median(disk[what])
        label = "push (durable)" if what == "write" else "receiver load"
        print(f"| object store, local disk | {label}, 64 MiB | {m:.3f} | {rate(m)} | | |")
    print()
    print_headline("bucketed_vs_raw", ratios[args.buckets[0]])


if __name__ == "__main__":
    main()
