"""JSON over HTTP to an inference server (SGLang or vLLM), and waiting for one to come up.

Every failure names the server, the path and the reason; the engines above (sglang_engine.py,
vllm_engine.py) add what their server's answers mean.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any


class ServerError(RuntimeError):
    """A server refused a request, answered something unreadable, or is unreachable."""


class ServerClient:
    """JSON over HTTP to one server; `api_key` goes as a bearer token when set."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
        self.url = url
        self.timeout_s = timeout_s
        self.api_key = api_key

    def get(self, path: str, timeout_s: float | None = None) -> Any:
        return self._call("GET", path, None, timeout_s)

    def post(self, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return self._call("POST", path, {} if body is None else body, timeout_s)

    def post_ok(self, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        """POST to an endpoint answering {"success", "message"}; ServerError when not a success."""
        answer = self.post(path, body, timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerError(f"{self.url}{path} failed: {answer.get('message', answer)}")
        return answer

    def _call(self, method: str, path: str, body: Any, timeout_s: float | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout_s or self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:500].decode(errors="replace")
            raise ServerError(f"{method} {self.url}{path}: HTTP {err.code}: {detail}") from err
        except (urllib.error.URLError, OSError) as err:
            raise ServerError(f"{method} {self.url}{path}: server unreachable ({err})") from err
        if not raw.strip():
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")


def wait_healthy(
    client: ServerClient,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    what: str = "SGLang server",
    path: str = "/health",
) -> None:
    """Poll `path` until the server answers 200; ServerError naming the cause otherwise."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServerError(f"{what} for {client.url} exited with code {proc.returncode}")
        try:
            client.get(path, timeout_s=5.0)
            return
        except ServerError as err:
            last = str(err)
        time.sleep(1.0)
    raise ServerError(f"{what} {client.url} not healthy within {timeout_s:.0f}s: {last}")
