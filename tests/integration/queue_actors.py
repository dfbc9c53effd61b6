"""Producer and consumer processes for the queue audit test (run as `python -m ...`).

Each actor appends what it did to its own JSONL record file (fsynced per line), so the test can
audit the queue against what every process believes it wrote or consumed, including one that
was killed.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from relax_core.queue import StageWorker, TransferQueue, rows_to_table, with_columns


def _queue(args: argparse.Namespace) -> TransferQueue:
    options = json.loads(os.environ.get("RELAX_TEST_STORAGE_OPTIONS", "{}"))
    return TransferQueue(args.root, args.run, options)


def _record(path: str, item: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(item) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _ready_then_wait(args: argparse.Namespace) -> None:
    """Say this process is up (`{record}.ready`), then wait for the test's go (`--go`), so every
    actor starts at once, whatever its start-up took, and they race."""
    if not args.go:
        return
    with open(f"{args.record}.ready", "w"):
        pass
    deadline = time.monotonic() + args.go_timeout
    while not os.path.exists(args.go):
        if time.monotonic() > deadline:
            raise SystemExit(f"no go ({args.go}) within {args.go_timeout} s")
        time.sleep(0.01)


def produce(args: argparse.Namespace) -> None:
    queue = _queue(args)
    _ready_then_wait(args)
    for e in range(args.entries):
        rows = [
            {
                "uid": f"p{args.index}-e{e}-g{g}-{i}",
                "group_id": f"p{args.index}-e{e}-g{g}",
                "response_ids": [e, g, i],
                "rollout_logprobs": [-0.5, -0.25, -0.125],
                "loss_mask": [1, 1, 1],
                "behaviour_version_min": 0,
                "behaviour_version_max": 0,
            }
            for g in range(args.groups)
            for i in range(2)
        ]
        seq = queue.put("rollout", rows_to_table(rows), {"producer": args.index})
        _record(args.record, {"seq": seq, "groups": sorted({r["group_id"] for r in rows})})


def consume(args: argparse.Namespace) -> None:
    queue = _queue(args)
    worker = StageWorker(queue, "rollout", "ref", args.worker, lease_ttl_s=args.ttl)
    _ready_then_wait(args)
    claimed = 0
    while True:
        progressed = False
        for lease, entry in worker.claim():
            claimed += 1
            if claimed == args.hang_after:
                # Hold the lease and stop making progress, like a wedged or killed worker.
                _record(args.record, {"hanging_on": lease.seq, "attempt": lease.attempt})
                while True:
                    time.sleep(60)
            table = entry.table
            table = with_columns(table, ref_logprobs=table.column("rollout_logprobs").to_pylist())
            won = worker.complete(lease, table)
            _record(args.record, {"seq": lease.seq, "attempt": lease.attempt, "committed": won})
            progressed = True
        if not progressed:
            if queue.stopped() and not worker.pending():
                return
            time.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["produce", "consume"])
    parser.add_argument("--root", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--record", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--entries", type=int, default=10)
    parser.add_argument("--groups", type=int, default=5)
    parser.add_argument("--worker", default="c0")
    parser.add_argument("--ttl", type=float, default=3.0)
    parser.add_argument("--hang-after", type=int, default=0)
    parser.add_argument("--go", default="", help="start once this file exists")
    parser.add_argument("--go-timeout", type=float, default=300.0)
    args = parser.parse_args()
    produce(args) if args.role == "produce" else consume(args)


if __name__ == "__main__":
    main()
