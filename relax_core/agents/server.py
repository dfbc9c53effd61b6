"""The OpenAI-compatible endpoint agents call during rollout (chat.py says what a call may ask).

Every request needs `Authorization: Bearer <token>` (the `api_key` an agent is given). Each
episode has its own base URL, `{url}/episodes/{id}/v1`, so any OpenAI client works unchanged:

    POST /episodes/{id}/v1/chat/completions    messages -> one assistant message
    POST /episodes/{id}/v1/completions         prompt (text or token ids) -> one completion
    GET  /episodes/{id}/v1/models              the served model

Answers: 200 served and recorded (`stream: true`: server-sent events, streaming.py); 400 a
request the endpoint refuses (request.py), or the episode's limits (env.max_turns calls,
env.max_episode_tokens response tokens, the policy's context) are spent, which ends it; 401 no
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
    Rendered,
    remember,
    response_body,
)
from relax_core.agents.recorder import Call, Trajectory
from relax_core.agents.request import Request, RequestError, parse_request
from relax_core.agents.streaming import sse
from relax_core.agents.toolcalls import ParsedReply, parse_reply, tool_names
from relax_core.rollout.engine import Completion

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
    context: int | None = None
    """Positions the policy takes (prompt + sampled); a call that would pass it is refused and
    ends the episode. None: unknown (the engine checks)."""


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
    tool_parse_errors: int = 0
    """Replies to calls with tools whose text held a call that is not a valid one."""


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024
    """Connections waiting to be accepted: every running agent may connect at once (with the
    stdlib's 5, some of 32 concurrent agents' connections went unanswered and were retried)."""


class AgentEndpoint:
    """The HTTP endpoint: episodes are opened and closed by the rollout that owns them."""

    def __init__(
        self, tokenizer: Any, host: str = "127.0.0.1", port: int = 0, tool_parser: str = "hermes"
    ) -> None:
        self.renderer = PromptRenderer(tokenizer, tool_parser)
        self.tool_parser = tool_parser
        self.token = secrets.token_urlsafe(24)
        self._episodes: dict[str, EpisodeCalls] = {}
        self._lock = threading.Lock()
        self.httpd = _Server((host, port), _handler(self))
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

    def serve_call(self, ep: EpisodeCalls, kind: str, body: Any) -> tuple[Request, dict]:
        """One call: render, generate, record; (the request, its response body). RequestError
        for what is refused."""
        req = parse_request(kind, body)
        rendered, cap = self._admit(ep, req)
        prompt_ids = rendered.ids
        comp = self._generate(ep, prompt_ids, cap)
        high = comp.policy_version if comp.policy_version_max is None else comp.policy_version_max
        sampled, logprobs, finish = list(comp.response_ids), list(comp.logprobs), comp.finish_reason
        reopen = "" if finish == "stop" else None
        full = text = self.renderer.text(sampled)
        cut = self.renderer.stop_cut(sampled, full, req.stop)
        if cut is not None:
            # The row keeps the ids up to the one that completed the stop string; the template's
            # end-of-turn comes in as observation tokens on the next call.
            k, text = cut
            sampled, logprobs, finish = sampled[:k], logprobs[:k], "stop"
            full = self.renderer.text(sampled)
            reopen = self.renderer.end_of_turn()
        call = Call(prompt_ids, sampled, logprobs, finish, comp.policy_version, high)
        parsed = self._reply(req, rendered.opening + text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
            finish = "tool_calls"
        with ep.lock:
            if ep.closed:
                raise RequestError("this episode has ended", status=410)
            ep.trajectory.add(call)
            remember(ep.conversation, req, prompt_ids, sampled, full, message, reopen)
            ep.sampling_overrides += req.sampling_asked
            ep.tool_parse_errors += parsed.errors
        texts = self.renderer.token_texts(sampled) if req.logprobs else None
        body = response_body(
            req, SERVED_MODEL, message, prompt_ids, sampled, logprobs, finish, high, texts
        )
        return req, body

    def _admit(self, ep: EpisodeCalls, req: Request) -> tuple[Rendered, int]:
        """The call's prompt and token cap, or RequestError: the episode has ended, or this call
        would pass one of its limits (which ends it)."""
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
            rendered = self.renderer.prompt_ids(req, ep.conversation)
            n = len(rendered.ids)
            room = limits.max_episode_tokens - ep.trajectory.response_tokens_after(rendered.ids)
            cap = min(limits.max_new_tokens, room, req.max_tokens or limits.max_new_tokens)
            if cap < 1:
                ep.limit_reached = "token_budget"
                raise RequestError(
                    f"this episode's {limits.max_episode_tokens} response tokens "
                    "(env.max_episode_tokens) are spent"
                )
            if limits.context is not None and n + cap > limits.context:
                ep.limit_reached = "context"
                raise RequestError(
                    f"the prompt of {n} tokens plus {cap} to sample does not fit the policy's "
                    f"context of {limits.context} positions; this episode has ended",
                    "messages" if req.kind == "chat" else "prompt",
                )
        return rendered, cap

    def _generate(self, ep: EpisodeCalls, prompt_ids: list[int], cap: int) -> Completion:
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
        return comp

    def _reply(self, req: Request, text: str) -> ParsedReply:
        """The reply's content and tool calls: parsed when the request offers tools (and
        tool_choice is not 'none'); parallel_tool_calls false keeps the first call."""
        if req.kind != "chat" or not req.tools or req.tool_choice == "none":
            return ParsedReply(text)
        parsed = parse_reply(self.tool_parser, text, tool_names(req.tools))
        if not req.parallel_tool_calls and len(parsed.tool_calls) > 1:
            return ParsedReply(parsed.content, parsed.tool_calls[:1], parsed.errors)
        return parsed


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
                answer = self._answer(method, body)
            except RequestError as err:
                return self._send(err.status, err.body())
            if isinstance(answer, tuple):
                req, answer = answer
                if req.stream:
                    return self._send_bytes(
                        200, sse(answer, req.include_usage), "text/event-stream"
                    )
            self._send(200, answer)

        def _answer(self, method: str, raw: bytes) -> dict[str, Any] | tuple[Request, dict]:
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
            self._send_bytes(status, json.dumps(payload).encode(), "application/json")

        def _send_bytes(self, status: int, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
