"""The elastic rollout pool's HTTP API (`elastic.py` says what the operations do).

Every request needs `Authorization: Bearer <token>`; bodies and answers are JSON.

    GET  /engines                         the pool: name, state, startup, pid, policy version
    POST /scale_out {"target": N}         grow the pool to N engines (nothing to do if it has N)
    POST /scale_in  {"target": N}         shrink it to N, the newest added engine first
    POST /scale_in  {"engines": [names]}  remove these engines
    GET  /scale_out/{id}, /scale_in/{id}  one operation: status, engines, message
    POST /scale_out/{id}/cancel, /scale_in/{id}/cancel

Answers: 202 an operation started (poll its URL); 200 done, nothing to do, or the same request
again while it runs (targets are idempotent, so a retried request starts nothing twice); 400 a
malformed or impossible request; 401 no or a wrong token; 404 unknown path or operation; 405
wrong method; 409 another operation runs (one at a time) or it has already ended. A rejected
request changes nothing.

The server binds `services.scale_api_host` (loopback unless configured) and writes its URL and
token to `{run_dir}/scale_api.json`, readable by its owner only; `relax scale` reads it.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from relax_core.ops.elastic import ApiError, ElasticPool

log = logging.getLogger(__name__)

TOKEN_ENV = "RELAX_SCALE_TOKEN"
API_FILE = "scale_api.json"
_MAX_BODY = 64 << 10


class ScaleServer:
    """The HTTP face of an `ElasticPool`, serving from daemon threads."""

    def __init__(self, pool: ElasticPool, host: str, port: int, token: str) -> None:
        if not token:
            raise ValueError("the scaling API needs a non-empty bearer token")
        self.pool = pool
        self.httpd = ThreadingHTTPServer((host, port), _handler(pool, token.encode()))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.1,), name="scale-api", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def api_token() -> str:
    return os.environ.get(TOKEN_ENV) or secrets.token_urlsafe(24)


def write_api_file(run_dir: str, url: str, token: str) -> str:
    """`{run_dir}/scale_api.json` with the URL and token, readable by its owner only."""
    path = os.path.join(run_dir, API_FILE)
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token, "pid": os.getpid()}, f)
    os.replace(tmp, path)
    return path


def _handler(pool: ElasticPool, token: bytes) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "relax-scale/1"

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def do_DELETE(self) -> None:
            self._dispatch("DELETE")

        def do_PATCH(self) -> None:
            self._dispatch("PATCH")

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("scale api: " + format, *args)

        def _dispatch(self, method: str) -> None:
            try:
                self._authorize()
                parts = [p for p in urlsplit(self.path).path.split("/") if p]
                status, answer = self._route(method, parts)
            except ApiError as err:
                status, answer = err.status, {"error": err.message, **err.extra}
            except Exception as err:  # noqa: BLE001 - answered, and logged for the operator
                log.exception("scale api: %s %s failed", method, self.path)
                status, answer = 500, {"error": f"{type(err).__name__}: {err}"}
            self._send(status, answer)

        def _route(self, method: str, parts: list[str]) -> tuple[int, dict[str, Any]]:
            kinds = ("scale_out", "scale_in")
            if parts == ["engines"]:
                self._method(method, "GET")
                return 200, pool.describe()
            if len(parts) == 1 and parts[0] in kinds:
                self._method(method, "POST")
                body = self._body()
                return pool.scale_out(body) if parts[0] == "scale_out" else pool.scale_in(body)
            if len(parts) == 2 and parts[0] in kinds:
                self._method(method, "GET")
                return 200, pool.operation(parts[0], parts[1])
            if len(parts) == 3 and parts[0] in kinds and parts[2] == "cancel":
                self._method(method, "POST")
                return 200, pool.cancel(parts[0], parts[1])
            raise ApiError(404, f"no such endpoint {self.path!r}; see GET /engines")

        def _method(self, method: str, allowed: str) -> None:
            if method != allowed:
                raise ApiError(405, f"{self.path} takes {allowed}, not {method}")

        def _authorize(self) -> None:
            header = self.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token):
                raise ApiError(401, "missing or wrong bearer token (Authorization: Bearer ...)")

        def _body(self) -> Any:
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise ApiError(400, "a JSON body with a Content-Length is required")
            if int(length) > _MAX_BODY:
                raise ApiError(400, f"the body is {length} bytes; at most {_MAX_BODY}")
            raw = self.rfile.read(int(length))
            try:
                return json.loads(raw)
            except (ValueError, UnicodeDecodeError) as err:
                raise ApiError(400, f"the body is not JSON: {err}") from None

        def _send(self, status: int, answer: dict[str, Any]) -> None:
            data = json.dumps(answer, indent=1).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 401:
                self.send_header("WWW-Authenticate", 'Bearer realm="relax"')
            self.end_headers()
            self.wfile.write(data)

    return Handler
