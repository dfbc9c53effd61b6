"""A stand-in SGLang server for contract tests (`python -m tests.integration.fake_sglang`).

SGLang cannot run on this CPU, so this server implements the part of SGLang 0.5.23's HTTP API the
rollout client and the weight sync use, with the same request and response fields, and refuses
what the pinned source refuses. It is stricter in one way: an unknown field is a 400 here, where
SGLang's request models ignore it, so a misspelt field (which SGLang would drop silently) fails a
test. What it does is real: it generates with a torch policy (log-probs included), and its weight
side (fake_sglang_weights.py) joins the trainer's weight group over gloo as each TP rank does.

Scheduling rules copied from the pinned source (facts, not code):
- start-up: until warm-up has run, `/health` and `/health_generate` answer 503 while other
  endpoints serve (http_server.health_generate: server_status Starting); here warm-up lasts
  `--warmup-s` seconds and, with `--warmup-until PATH`, until PATH exists (a test ends it);
- `/pause_generation` (Scheduler.pause_generation): `in_place` sets the flag and returns, running
  requests stay in the batch with their KV cache and go on after continue; `retract` takes them
  out of the batch between decode steps, frees their KV cache and puts them back in the waiting
  queue, keeping the tokens generated so far (Req.reset_for_retract keeps output_ids); after
  `/continue_generation` they are prefilled again (prompt + output so far, under the weights then
  held) and finish, the HTTP request never fails, and `meta_info.num_retractions` counts it;
  `abort` is modelled as waiting for running requests to end;
- an MoE policy serves `return_routed_experts` (base64 int32 [prompt + output - 1, layers,
  top_k]); a dense one refuses it, as a server without `--enable-return-routed-experts`;
- with `--api-key` every request but /health* needs `Authorization: Bearer <key>`
  (srt/utils/auth.py, decide_request_auth).

LoRA (`--enable-lora`, adapters loaded by name, `lora_path` on /generate, `GET /v1/models`) is
fake_sglang_lora.py, with the rules it copies.

Test-only endpoints: `GET /relax_test/events` (generate start/end with the weight version, retract,
update begin/end, pause, continue), `GET /relax_test/digest` (sha256 of every parameter's bytes)
and `GET /relax_test/loaded` (every weight name sent: consumed or ignored by load_weights).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch

from relax_core.models.routing_replay import attach_routing_replay
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from tests.integration.fake_sglang_lora import FakeLoRA
from tests.integration.fake_sglang_weights import FakeWeights, ServerError

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
    "/flush_cache": (set(), set()),
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
MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}
SAMPLING = {"max_new_tokens", "temperature", "top_p", "skip_special_tokens", "stop_token_ids"}


class BadRequest(Exception):
    pass


class FakeSGLang:
    """The scheduler: requests, pauses, memory; the weights are `self.weights`'."""

    def __init__(
        self,
        model,
        eos: int,
        pad: int,
        generate_delay_s: float,
        step_delay_s: float = 0.0,
        tp_size: int = 1,
        dp_size: int = 1,
        warmup_s: float = 0.0,
        lora: dict | None = None,
        warmup_until: str = "",
    ) -> None:
        self.moe = bool(getattr(model.config, "num_experts", 0))
        if self.moe:
            attach_routing_replay(model)
        self.model = model
        self.engine = TorchEngine(model, eos, pad, seed=0)
        self.engine.weight_poll = self._between_steps
        self.weight_version = "default"
        self.events: list[list] = []
        self.cond = threading.Condition()
        self.paused = ""
        """The pause mode in force ('' when generating)."""
        self.busy = False
        """A forward or a weight load holds the model (one at a time, as the scheduler loop)."""
        self.running = 0
        """Requests in the running batch (one computing, in_place ones paused mid-way)."""
        self.waiting = 0
        """Requests in the waiting queue (new, or retracted)."""
        self.local = threading.local()
        self.generate_delay_s, self.step_delay_s = generate_delay_s, step_delay_s
        self.ready_at = time.monotonic() + warmup_s
        self.warmup_until = warmup_until
        """A file whose appearance ends warm-up (with ready_at), when set."""
        self.released: set[str] = set()
        """Memory tags released (colocate): generating needs none released, loading weights
        needs 'weights' held."""
        self.tp_size, self.dp_size = tp_size, dp_size
        self.weights = FakeWeights(self, tp_size, dp_size)
        self.lora = FakeLoRA(self, **(lora or {}))
        self.served_model = "fake"

    def event(self, *what) -> None:
        with self.cond:
            self.events.append([time.time(), *what])
            record = os.environ.get("RELAX_TEST_SGLANG_EVENTS")
            if record:  # a server started by the product under test outlives no assertion
                with open(record, "a") as f:
                    f.write(json.dumps([time.time(), *what]) + "\n")

    # ------------------------------------------------------------------ the model, one at a time
    def _take_model(self) -> None:
        """Wait (under cond) until generation may run and nothing holds the model; take it."""
        while self.paused or self.busy:
            self.cond.wait()
        self.busy = True

    def _give_model(self) -> None:
        self.busy = False
        self.cond.notify_all()

    @contextlib.contextmanager
    def model_held(self):
        """For a weight load: the model, once no forward runs (paused requests hold none)."""
        with self.cond:
            while self.busy:
                self.cond.wait()
            self.busy = True
        try:
            yield
        finally:
            with self.cond:
                self._give_model()

    def idle_for_flush(self) -> bool:
        """Scheduler.is_fully_idle(ignore_waiting=paused): no running request, and no waiting
        one unless generation is paused."""
        with self.cond:
            return self.running == 0 and (bool(self.paused) or self.waiting == 0)

    def _between_steps(self) -> bool:
        """TorchEngine calls this between decode steps of the request holding the model: where
        SGLang's scheduler loop takes a pause. True when the KV cache must be rebuilt (retract)."""
        self.local.tokens += 1
        time.sleep(self.step_delay_s)
        with self.cond:
            mode = self.paused
            if not mode:
                return False
            if mode == "retract":
                self.running, self.waiting = self.running - 1, self.waiting + 1
                self.local.retractions += 1
            self._give_model()
        if mode == "retract":
            self.event("retract", self.local.tokens)
        with self.cond:
            self._take_model()
            if mode == "retract":
                self.running, self.waiting = self.running + 1, self.waiting - 1
        return mode == "retract"

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict) -> list | dict:
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else ids
        sp = body["sampling_params"]
        if body.get("return_routed_experts") and not self.moe:
            raise BadRequest("return_routed_experts: the served model has no MoE routers")
        if unknown := set(sp) - SAMPLING:
            raise BadRequest(f"unknown sampling_params {sorted(unknown)}")
        temperature = float(sp.get("temperature", 1.0))
        params = SamplingParams(
            int(sp["max_new_tokens"]),
            temperature if temperature > 0 else 1.0,
            float(sp.get("top_p", 1.0)),
            greedy=temperature == 0,
        )
        if self.released:
            raise BadRequest(f"generate while memory is released ({sorted(self.released)})")
        adapters = self.lora.acquire(body.get("lora_path"), len(prompts))
        self.local.tokens, self.local.retractions = 0, 0
        try:
            with self.cond:  # queued until generation runs and the model is free
                self.waiting += 1
                self._take_model()
                self.waiting, self.running = self.waiting - 1, self.running + 1
            try:
                self.event("generate_start", self.weight_version)
                if any(adapters):
                    self.event("lora_generate", sorted({a.name for a in adapters if a}))
                time.sleep(self.generate_delay_s)
                completions = self._generate_with(prompts, params, adapters)
                version = self.weight_version
                self.event("generate_end", version)
            finally:
                with self.cond:
                    self.running -= 1
                    self._give_model()
        finally:
            self.lora.release(adapters)
        out = []
        for i, c in enumerate(completions):
            meta = {
                "id": f"req-{i}",
                "finish_reason": {"type": c.finish_reason},
                "prompt_tokens": len(prompts[i]),
                "completion_tokens": len(c.response_ids),
                "weight_version": version,
                "num_retractions": self.local.retractions,
            }
            if body.get("return_logprob"):
                meta["output_token_logprobs"] = [
                    [lp, t, None] for lp, t in zip(c.logprobs, c.response_ids, strict=True)
                ]
            if body.get("return_routed_experts"):
                experts = np.asarray(c.routed_experts, dtype=np.int32)
                meta["routed_experts"] = base64.b64encode(experts.tobytes()).decode("utf-8")
            out.append({"text": "", "output_ids": c.response_ids, "meta_info": meta})
        return out[0] if single else out

    def _generate_with(self, prompts: list, params: SamplingParams, adapters: list) -> list:
        """Each adapter's prompts together, under it (SGLang batches requests of at most
        --max-loras-per-batch adapters; one at a time is within that)."""
        out: list = [None] * len(prompts)
        for adapter in {id(a): a for a in adapters}.values():
            rows = [i for i, a in enumerate(adapters) if a is adapter]
            with self.lora.applied(adapter):
                done = self.engine.generate([prompts[i] for i in rows], params)
            for i, completion in zip(rows, done, strict=True):
                out[i] = completion
        return out

    def pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"Invalid mode: {mode!r}")
        with self.cond:
            if mode == "abort":  # running requests end first (here: finish)
                while self.waiting or self.running:
                    self.cond.wait()
            self.paused = mode
            # retract returns once the running batch is empty: the request computing now is
            # retracted at its next step; in_place returns at once.
            while mode == "retract" and self.running:
                self.cond.wait()
        self.event("pause", mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def resume(self, body: dict) -> dict:
        with self.cond:
            self.paused = ""
            self.cond.notify_all()
        self.event("continue")
        return {"message": "Generation continued successfully.", "status": "ok"}

    def release(self, body: dict) -> dict:
        tags = set(body.get("tags") or MEMORY_TAGS)
        if tags - MEMORY_TAGS:
            raise BadRequest(f"unknown memory tags {sorted(tags - MEMORY_TAGS)}")
        with self.cond:
            if not self.idle_for_flush():
                raise BadRequest("release_memory_occupation should be called only when idle")
            self.released |= tags
        self.event("release", sorted(tags))
        return {"success": True, "message": "released"}

    def resume_memory(self, body: dict) -> dict:
        tags = set(body.get("tags") or MEMORY_TAGS)
        self.released -= tags
        self.event("resume_memory", sorted(tags))
        return {"success": True, "message": "resumed"}

    def warm(self) -> bool:
        """Whether warm-up has run: /health answers 200 from then on."""
        if time.monotonic() < self.ready_at:
            return False
        return not self.warmup_until or os.path.exists(self.warmup_until)

    def server_info(self) -> dict:
        return {"tp_size": self.tp_size, "dp_size": self.dp_size, "pp_size": 1}

    def digest(self) -> dict:
        with self.model_held():
            return {
                n: hashlib.sha256(
                    p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                ).hexdigest()
                for n, p in self.model.named_parameters()
            }


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


def serve(state: FakeSGLang, port: int, api_key: str = "") -> ThreadingHTTPServer:
    w = state.weights
    posts = {
        "/generate": state.generate,
        "/init_weights_update_group": w.init_group,
        "/update_weights_from_distributed": w.update_distributed,
        "/update_weights_from_tensor": w.update_tensor,
        "/begin_weight_update": w.begin,
        "/end_weight_update": w.end,
        "/destroy_weights_update_group": w.destroy_group,
        "/pause_generation": state.pause,
        "/continue_generation": state.resume,
        "/flush_cache": lambda body: {"success": True, "message": ""},
        "/update_weights_from_disk": w.update_disk,
        "/release_memory_occupation": state.release,
        "/resume_memory_occupation": state.resume_memory,
        "/load_lora_adapter_from_tensors": state.lora.load_from_tensors,
        "/unload_lora_adapter": state.lora.unload,
    }

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, payload) -> None:
            raw = b"" if payload is None else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _refused(self) -> bool:
            """SGLang's rule with --api-key: the key on everything but /health*."""
            allowed = self.headers.get("Authorization") == f"Bearer {api_key}"
            if not api_key or allowed or self.path.startswith("/health"):
                return False
            self._send(401, {"error": "Unauthorized"})
            return True

        def do_GET(self):
            if self._refused():
                return
            if self.path in ("/health", "/health_generate", "/ready"):
                return self._send(200 if state.warm() else 503, None)
            gets = {
                "/get_model_info": lambda: {
                    "model_path": "fake",
                    "is_generation": True,
                    "weight_version": state.weight_version,
                },
                "/get_server_info": state.server_info,
                "/v1/models": lambda: state.lora.models(state.served_model),
                "/server_info": state.server_info,
                "/relax_test/events": lambda: state.events,
                "/relax_test/digest": state.digest,
                "/relax_test/loaded": w.loaded,
            }
            if self.path not in gets:
                return self._send(404, {"detail": "Not Found"})
            self._send(200, gets[self.path]())

        def do_POST(self):
            if self._refused():
                return
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--checkpoint", help="a policy directory (load_policy)")
    p.add_argument("--tiny-seed", type=int, default=0, help="else: the tests' tiny policy")
    p.add_argument("--generate-delay-s", type=float, default=0.0)
    p.add_argument("--step-delay-s", type=float, default=0.0, help="per decode step")
    p.add_argument("--warmup-s", type=float, default=0.0, help="/health answers 503 this long")
    p.add_argument("--warmup-until", default="", help="/health answers 503 until this file exists")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--dp-size", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default="")
    p.add_argument("--enable-lora", action="store_true")
    p.add_argument("--max-lora-rank", type=int)
    p.add_argument("--lora-target-modules", nargs="*")
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.checkpoint:
        from relax_core.models.lora import has_adapter
        from relax_core.models.policy import load_policy, load_tokenizer

        if has_adapter(a.checkpoint):  # SGLang loads the directory's weights: the base alone
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
            tok = load_tokenizer(a.checkpoint)
        else:
            model, tok = load_policy(a.checkpoint)
    else:
        from tests.integration.weight_sync_actors import tiny_policy

        model, tok = tiny_policy(a.tiny_seed)
    state = FakeSGLang(
        model.to(a.device),
        tok.eos_token_id,
        tok.pad_token_id,
        a.generate_delay_s,
        a.step_delay_s,
        a.tp_size,
        a.dp_size,
        a.warmup_s,
        lora={
            "enabled": a.enable_lora,
            "max_rank": a.max_lora_rank,
            "targets": a.lora_target_modules,
            "max_per_batch": a.max_loras_per_batch,
        },
        warmup_until=a.warmup_until,
    )
    state.weight_version = a.weight_version
    state.served_model = a.checkpoint or "fake"
    serve(state, a.port, a.api_key).serve_forever()


if __name__ == "__main__":
    main()
