"""A client of the elastic rollout API (scale_api.py), and `relax scale`.

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
import time
import urllib.error
import urllib.request
from typing import Any

from relax_core.ops.scale_api import API_FILE


class ScaleApiError(RuntimeError):
    def __init__(self, status: int, answer: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {answer.get('error', answer)}")
        self.status, self.answer = status, answer


class ScaleClient:
    def __init__(self, url: str, token: str, timeout_s: float = 30.0) -> None:
        self.url, self.token, self.timeout_s = url.rstrip("/"), token, timeout_s

    @classmethod
    def for_run(cls, run_dir: str) -> ScaleClient:
        path = os.path.join(run_dir, API_FILE)
        try:
            with open(path) as f:
                info = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} does not exist: the run is not going on, was not launched by the local "
                "launcher (mode: async, launch: processes), or has services.scale_api off"
            ) from None
        return cls(info["url"], info["token"])

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, dict[str, Any]]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, json.load(resp)
        except urllib.error.HTTPError as err:
            raise ScaleApiError(err.code, json.load(err)) from None

    def engines(self) -> dict[str, Any]:
        return self.call("GET", "/engines")[1]

    def scale_out(self, target: int) -> dict[str, Any]:
        return self.call("POST", "/scale_out", {"target": target})[1]

    def register(self, urls: list[str]) -> dict[str, Any]:
        """Add running SGLang servers to the pool (external engines)."""
        return self.call("POST", "/scale_out", {"urls": list(urls)})[1]

    def scale_in(self, target: int | None = None, engines: list[str] | None = None):
        body = {"target": target} if engines is None else {"engines": engines}
        return self.call("POST", "/scale_in", body)[1]

    def cancel(self, op: dict[str, Any]) -> dict[str, Any]:
        return self.call("POST", f"{op['url']}/cancel", {})[1]

    def wait(self, op: dict[str, Any], timeout_s: float = 600.0, poll_s: float = 0.5):
        """Poll an operation until it ends; returns its final state."""
        if op.get("id") is None:
            return op  # nothing was to be done
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.call("GET", op["url"])[1]
            if state["status"] not in ("running", "cancelling"):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"{op['kind']} {op['id']} still {state['status']}")
            time.sleep(poll_s)


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
