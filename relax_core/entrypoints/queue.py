"""`relax queue ROOT [--run RUN_ID] [--json]`: inspect a run's queue, or list the runs under ROOT."""

from __future__ import annotations

import argparse
import json
import sys

from relax_core.queue.errors import StorageError
from relax_core.queue.inspect import list_runs, render, summarize
from relax_core.queue.queue import TransferQueue


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="queue root: a directory or s3://bucket/prefix (queue.root)")
    parser.add_argument("--run", help="run id; without it, list the runs under ROOT")
    parser.add_argument("--endpoint-url", default="", help="S3 endpoint (queue.endpoint_url)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    options = {"client_kwargs": {"endpoint_url": args.endpoint_url}} if args.endpoint_url else {}
    try:
        if not args.run:
            runs = list_runs(args.root, options)
            if args.json:
                print(json.dumps(runs))
            elif runs:
                print("\n".join(runs))
            else:
                print(f"no run queues under {args.root}", file=sys.stderr)
                return 1
            return 0
        queue = TransferQueue(args.root, args.run, options)
        summary = summarize(queue)
    except StorageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not any(s["entries"] for s in summary["stages"].values()):
        print(f"no queue entries for run {args.run!r} at {summary['url']}", file=sys.stderr)
        return 1
    if args.json:
        for stage in summary["stages"].values():
            stage.pop("seqs")
        print(json.dumps(summary, indent=1))
    else:
        print(render(summary))
    return 0
