"""`relax scale`: show, grow or shrink a running async run's rollout engines (ops/elastic.py).

    relax scale RUN                      the engine pool and the operation in progress
    relax scale RUN --out 3 [--wait]     grow the pool to 3 engines
    relax scale RUN --add-url URL...     register running SGLang servers as engines
    relax scale RUN --in 1 [--wait]      shrink it to 1 (drained first; startup engines stay)
    relax scale RUN --remove rollout-3   remove named engines
    relax scale RUN --cancel             cancel the operation in progress

RUN is a run directory (`.relax/checkpoints/<run id>`) or a run id under `--checkpoints`; the
URL and token come from its `scale_api.json`, which exists while the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from relax_core.ops.scale_client import ScaleApiError, ScaleClient


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN", help="run directory, or run id under --checkpoints")
    parser.add_argument("--checkpoints", default=".relax/checkpoints", help="checkpoint.dir")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--out", type=int, metavar="N", help="grow the pool to N engines")
    what.add_argument(
        "--add-url", nargs="+", metavar="URL", help="register running SGLang servers as engines"
    )
    what.add_argument("--in", dest="in_", type=int, metavar="N", help="shrink the pool to N")
    what.add_argument("--remove", nargs="+", metavar="ENGINE", help="remove these engines")
    what.add_argument("--cancel", action="store_true", help="cancel the running operation")
    parser.add_argument("--wait", action="store_true", help="wait until the operation ends")


def _print_pool(pool: dict[str, Any]) -> None:
    for e in pool["engines"]:
        startup = "startup" if e["startup"] else ("sglang" if e.get("url") else "added")
        version = "-" if e["policy_version"] is None else f"v{e['policy_version']}"
        where = f" {e['url']}" if e.get("url") else ""
        print(
            f"{e['name']:<12} {e['state']:<9} {startup:<8} {version:<6} {e['doing'] or ''}{where}"
        )
    op = pool["operation"]
    if op:
        print(f"operation {op['kind']} {op['id']}: {op['status']} {op['message']}")


def run(args: argparse.Namespace) -> int:
    run_dir = args.run if os.path.isdir(args.run) else os.path.join(args.checkpoints, args.run)
    try:
        client = ScaleClient.for_run(run_dir)
        if args.out is not None:
            op = client.scale_out(args.out)
        elif args.add_url:
            op = client.register(args.add_url)
        elif args.in_ is not None:
            op = client.scale_in(target=args.in_)
        elif args.remove:
            op = client.scale_in(engines=args.remove)
        elif args.cancel:
            current = client.engines()["operation"]
            if current is None:
                print("no operation in progress", file=sys.stderr)
                return 1
            op = client.cancel(current)
        else:
            _print_pool(client.engines())
            return 0
        if args.wait:
            op = client.wait(op)
        print(json.dumps(op, indent=1))
        return 0 if op["status"] in ("running", "cancelling", "succeeded", "cancelled") else 1
    except (FileNotFoundError, ScaleApiError, OSError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
