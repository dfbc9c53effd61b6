"""The HTTP side of the stand-in SGLang server (fake_sglang.py): routes, request checks, answers.

Request bodies are checked against the fields SGLang 0.5.23's request models have (io_struct.py):
a missing field is refused as SGLang refuses it, an unknown one too (SGLang would drop it
silently; here a misspelt field fails a test). Rules of the routes, from srt/entrypoints/
http_server.py:
- `/health`, `/health_generate`: 503 while starting; else a one-token generation, answered no
  sooner than `--health-s` (SGLang: 1 s), 503 while generation is paused (no token comes);
- `/ready`: at once, 200 when started and not paused (TokenizerManager.is_ready), else 503;
- `/get_model_info`, `/get_server_info`: deprecated aliases of `/model_info`, `/server_info`
  that log a WARNING on every call;
- `/flush_cache` (GET or POST, `?timeout=` seconds): plain text, 200 or 400
  (fake_sglang_cache.py);
- with `--api-key`, every route but /health*, /ready* and /metrics* needs the key
  (srt/utils/auth.py).
"""

from __future__ import annotations

import json
import logging
import os
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from tests.integration.fake_sglang_weights import ServerError

log = logging.getLogger("sglang.srt.entrypoints.http_server")

BASE = {"rid", "http_worker_ipc"}  # every control request's BaseReq fields (io_struct.py)
UPDATE = {"flush_cache", "abort_all_requests", "weight_version", "selector", "torch_empty_cache"}
REQUIRED = {
    "/generate": (
        {"input_ids", "sampling_params"},
        {"return_logprob", "stream", "rid", "return_routed_experts", "lora_path"},
    ),
    "/init_weights_update_group": (
        {"master_address", "master_port", "rank_offset", "world_size"},
        {"group_name", "backend"},
    ),
    "/update_weights_from_distributed": (
        {"names", "dtypes", "shapes"},
        {"group_name", "load_format", *UPDATE},
    ),
    "/update_weights_from_tensor": ({"serialized_named_tensors"}, {"load_format", *UPDATE}),
    "/begin_weight_update": (set(), {"selector"}),
    "/end_weight_update": (set(), set()),
    "/destroy_weights_update_group": (set(), {"group_name"}),
    "/pause_generation": (set(), {"mode"}),
    "/continue_generation": (set(), {"torch_empty_cache"}),
    "/update_weights_from_disk": (
        {"model_path"},
        {"load_format", "keep_pause", "recapture_cuda_graph", "token_step", "is_async", *UPDATE},
    ),
    "/release_memory_occupation": (set(), {"tags"}),
    "/resume_memory_occupation": (set(), {"tags"}),
    "/load_lora_adapter_from_tensors": (
        {"lora_name", "config_dict", "serialized_named_tensors"},
        {"pinned", "added_tokens_config", "lora_id", "load_format", "expected_checksums"},
    ),
    "/unload_lora_adapter": ({"lora_name"}, {"lora_id"}),
}


class BadRequest(Exception):
    pass


# Endpoints whose failure SGLang answers with HTTP 400 {"success": false, "message"}.
FAIL_400 = {
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/begin_weight_update",
    "/end_weight_update",
    "/load_lora_adapter_from_tensors",
    "/unload_lora_adapter",
}


def model_info(state) -> dict:
    return {
        "model_path": state.served_model,
        "served_model_name": state.served_model,
        "is_generation": True,
        "weight_version": state.weight_version,
        "model_type": state.model.config.model_type,
    }


def deprecated(state, path: str, new: str, answer):
    """SGLang 0.5.23 answers a deprecated path as its new one, with a WARNING each call."""

    def call():
        log.warning(
            "Endpoint '%s' is deprecated and will be removed in a future version. "
            "Please use '%s' instead.",
            path,
            new,
        )
        state.event("deprecated", path)
        return answer()

    return call


def health(state, path: str) -> int:
    if not state.warm():
        return 503
    if path == "/ready":
        return 503 if state.paused else 200
    time.sleep(state.health_s)  # health_generate: asyncio.sleep(1) before it looks
    return 503 if state.paused else 200


def _posts(state) -> dict:
    w = state.weights
    return {
        "/generate": state.generate,
        "/init_weights_update_group": w.init_group,
        "/update_weights_from_distributed": w.update_distributed,
        "/update_weights_from_tensor": w.update_tensor,
        "/begin_weight_update": w.begin,
        "/end_weight_update": w.end,
        "/destroy_weights_update_group": w.destroy_group,
        "/pause_generation": state.pause,
        "/continue_generation": state.resume,
        "/update_weights_from_disk": w.update_disk,
        "/release_memory_occupation": state.release,
        "/resume_memory_occupation": state.resume_memory,
        "/load_lora_adapter_from_tensors": state.lora.load_from_tensors,
        "/unload_lora_adapter": state.lora.unload,
    }


def _gets(state) -> dict:
    info = lambda: model_info(state)  # noqa: E731
    return {
        "/model_info": info,
        "/get_model_info": deprecated(state, "/get_model_info", "/model_info", info),
        "/server_info": state.server_info,
        "/get_server_info": deprecated(
            state, "/get_server_info", "/server_info", state.server_info
        ),
        "/v1/models": lambda: state.lora.models(state.served_model),
        "/relax_test/events": lambda: state.events,
        "/relax_test/digest": state.digest,
        "/relax_test/loaded": state.weights.loaded,
        "/relax_test/pid": os.getpid,
    }


def serve(state, port: int, api_key: str = "") -> ThreadingHTTPServer:
    posts, gets = _posts(state), _gets(state)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload, content_type: str = "application/json") -> None:
            if isinstance(payload, str):
                raw = payload.encode()
            else:
                raw = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _refused(self) -> bool:
            """SGLang's rule with --api-key: the key on everything but /health*, /ready*."""
            allowed = self.headers.get("Authorization") == f"Bearer {api_key}"
            if not api_key or allowed or self.path.startswith(("/health", "/ready")):
                return False
            self._send(401, {"error": "Unauthorized"})
            return True

        def _flush(self) -> None:
            query = parse_qs(urlsplit(self.path).query)
            ok, text = state.flusher.flush(float(query.get("timeout", ["0"])[0]))
            self._send(200 if ok else 400, text, "text/plain")

        def do_GET(self):
            if self._refused():
                return
            if self.path in ("/health", "/health_generate", "/ready"):
                return self._send(health(state, self.path), None)
            if urlsplit(self.path).path == "/flush_cache":
                return self._flush()
            if self.path not in gets:
                return self._send(404, {"detail": "Not Found"})
            self._send(200, gets[self.path]())

        def do_POST(self):
            if self._refused():
                return
            if urlsplit(self.path).path == "/flush_cache":
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                return self._flush()
            if self.path not in posts:
                return self._send(404, {"detail": "Not Found"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                required, optional = REQUIRED[self.path]
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                if missing := required - set(body):
                    raise BadRequest(f"missing field(s) {sorted(missing)}")
                if unknown := set(body) - required - optional - BASE:
                    raise BadRequest(f"unknown field(s) {sorted(unknown)}")
                answer = posts[self.path](body)
            except ServerError as err:
                return self._send(500, {"error": {"message": f"AssertionError: {err}"}})
            except (BadRequest, ValueError, KeyError, TypeError) as err:
                return self._send(400, {"error": {"message": str(err)}})
            failed = isinstance(answer, dict) and answer.get("success") is False
            self._send(400 if failed and self.path in FAIL_400 else 200, answer)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server
