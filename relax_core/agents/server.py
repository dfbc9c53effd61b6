"""The OpenAI-compatible endpoint agents call during rollout (chat.py says what a call may ask).

Every request needs `Authorization: Bearer <token>` (the `api_key` an agent is given). Each
episode has its own base URL, `{url}/episodes/{id}/v1`, so any OpenAI client works unchanged:

    POST /episodes/{id}/v1/chat/completions    messages -> one assistant message
    POST /episodes/{id}/v1/completions         prompt (text or token ids) -> one completion
    GET  /episodes/{id}/v1/models              the served model

Answers: 200 served and recorded; 400 a request the endpoint refuses, or the episode's limits
(env.max_turns calls, env.max_episode_tokens response tokens) are spent, which ends it; 401 no
or a wrong token; 404 unknown path or episode; 410 the episode has ended (timed out, or its
rollout is over); 503 the engine failed or aborted the call (an OpenAI client retries these; a
failed engine also fails the rollout, which the role retries). A refused call records nothing.
The server binds loopback unless told otherwise and serves from daemon threads.
"""

from __future__ import annotations

import hmac
import json
import logging
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from relax_core.agents.batcher import BatcherClosed, EngineBatcher
from relax_core.agents.chat import (
    Conversation,
    PromptRenderer,
    RequestError,
    parse_request,
    remember,
    response_body,
)
from relax_core.agents.recorder import Call, Trajectory

log = logging.getLogger(__name__)

_MAX_BODY = 16 << 20
SERVED_MODEL = "policy"
_ROUTES = {"chat/completions": "chat", "completions": "completion"}


@dataclass(frozen=True)
class CallLimits:
    max_calls: int
    """Engine calls per episode."""
    max_episode_tokens: int
    """Response tokens a row (segment) may hold, sampled and observation tokens together."""
    max_new_tokens: int
    """Sampled tokens per call (a request's max_tokens may only lower it)."""


@dataclass
class EpisodeCalls:
    """One episode's record on the endpoint."""

    batcher: EngineBatcher
    limits: CallLimits
    trajectory: Trajectory = field(default_factory=Trajectory)
    conversation: Conversation = field(default_factory=Conversation)
    lock: threading.Lock = field(default_factory=threading.Lock)
    limit_reached: str | None = None
    """'max_turns' or 'token_budget' once a call was refused for it."""
    closed: bool = False
    sampling_overrides: int = 0
    """Calls that asked for a temperature or top_p (the run's were used)."""
    engine_error: BaseException | None = None


class AgentEndpoint:
    """The HTTP endpoint: episodes are opened and closed by the rollout that owns them."""

    def __init__(self, tokenizer: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.renderer = PromptRenderer(tokenizer)
        self.token = secrets.token_urlsafe(24)
        self._episodes: dict[str, EpisodeCalls] = {}
        self._lock = threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, args=(0.1,), name="agent-endpoint", daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def open_episode(self, batcher: EngineBatcher, limits: CallLimits) -> tuple[str, str]:
        """(episode id, the base URL its agent is given)."""
        eid = secrets.token_hex(8)
        with self._lock:
            self._episodes[eid] = EpisodeCalls(batcher, limits)
        return eid, f"{self.url}/episodes/{eid}/v1"

    def close_episode(self, eid: str) -> EpisodeCalls:
        """End an episode: later calls get 410, a call in flight is not recorded."""
        with self._lock:
            ep = self._episodes.pop(eid)
        with ep.lock:
            ep.closed = True
        return ep

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def episode(self, eid: str) -> EpisodeCalls | None:
        with self._lock:
            return self._episodes.get(eid)

    def serve_call(self, ep: EpisodeCalls, kind: str, body: Any) -> dict[str, Any]:
        """One call: render, generate, record. RequestError for what is refused."""
        req = parse_request(kind, body)
        limits = ep.limits
        with ep.lock:
            if ep.closed:
                raise RequestError("this episode has ended", status=410)
            if ep.limit_reached:
                raise RequestError(f"this episode has ended ({ep.limit_reached})")
            if ep.trajectory.calls >= limits.max_calls:
                ep.limit_reached = "max_turns"
                raise RequestError(
                    f"this episode has made its {limits.max_calls} calls (env.max_turns)"
                )
            prompt_ids = self.renderer.prompt_ids(req, ep.conversation)
            room = limits.max_episode_tokens - ep.trajectory.response_tokens_after(prompt_ids)
            cap = min(limits.max_new_tokens, room, req.max_tokens or limits.max_new_tokens)
            if cap < 1:
                ep.limit_reached = "token_budget"
                raise RequestError(
                    f"this episode's {limits.max_episode_tokens} response tokens "
                    "(env.max_episode_tokens) are spent"
                )
        try:
            comp = ep.batcher.submit(prompt_ids, cap)
        except BatcherClosed as err:
            raise RequestError(str(err), status=410) from err
        except Exception as err:  # noqa: BLE001 - the rollout sees it through engine_error
            ep.engine_error = err
            raise RequestError(
                f"the engine failed: {type(err).__name__}: {err}", status=503
            ) from err
        if comp.finish_reason == "abort":
            raise RequestError(
                "the engine aborted the call (weights are changing); retry", status=503
            )
        high = comp.policy_version if comp.policy_version_max is None else comp.policy_version_max
        sampled = list(comp.response_ids)
        text = self.renderer.text(sampled)
        with ep.lock:
            if ep.closed:
                raise RequestError("this episode has ended", status=410)
            ep.trajectory.add(
                Call(
                    prompt_ids,
                    sampled,
                    list(comp.logprobs),
                    comp.finish_reason,
                    comp.policy_version,
                    high,
                )
            )
            remember(ep.conversation, req, prompt_ids, sampled, text, comp.finish_reason == "stop")
            ep.sampling_overrides += req.sampling_asked
        texts = self.renderer.token_texts(sampled) if req.logprobs else None
        return response_body(
            req,
            SERVED_MODEL,
            text,
            prompt_ids,
            sampled,
            list(comp.logprobs),
            comp.finish_reason,
            high,
            texts,
        )


def _handler(endpoint: AgentEndpoint) -> type[BaseHTTPRequestHandler]:
    token = endpoint.token.encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
            log.debug("agent endpoint: " + format, *args)

        def do_GET(self) -> None:  # noqa: N802 - stdlib name
            self._dispatch("GET")

        def do_POST(self) -> None:  # noqa: N802 - stdlib name
            self._dispatch("POST")

        def _dispatch(self, method: str) -> None:
            body = b""
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                self.close_connection = True
                return self._send(413, RequestError(f"body over {_MAX_BODY} bytes").body())
            if length:
                body = self.rfile.read(length)
            try:
                self._send(200, self._answer(method, body))
            except RequestError as err:
                self._send(err.status, err.body())

        def _answer(self, method: str, raw: bytes) -> dict[str, Any]:
            given = self.headers.get("Authorization", "")
            if not given.startswith("Bearer ") or not hmac.compare_digest(
                given[len("Bearer ") :].strip().encode(), token
            ):
                raise RequestError(
                    "missing or wrong bearer token (the agent's api_key)", status=401
                )
            parts = urlsplit(self.path).path.strip("/").split("/", 3)
            if len(parts) != 4 or parts[0] != "episodes" or parts[2] != "v1":
                raise RequestError(f"unknown path {self.path!r}", status=404)
            ep = endpoint.episode(parts[1])
            if ep is None:
                raise RequestError(f"no episode {parts[1]!r} is running", status=404)
            route = parts[3]
            if route == "models":
                if method != "GET":
                    raise RequestError("use GET for /models", status=405)
                return {
                    "object": "list",
                    "data": [{"id": SERVED_MODEL, "object": "model", "owned_by": "relax"}],
                }
            if route not in _ROUTES:
                raise RequestError(f"unknown path {self.path!r}", status=404)
            if method != "POST":
                raise RequestError(f"use POST for /{route}", status=405)
            try:
                body = json.loads(raw or b"null")
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise RequestError(f"the body is not JSON: {err}") from err
            return endpoint.serve_call(ep, _ROUTES[route], body)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
