"""A client of the elastic rollout API (scale_api.py): what `relax scale` and tests call.
The URL and token of a run's API come from its run directory's `scale_api.json`, which exists
while the run goes on."""

from __future__ import annotations

import json
import os
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
