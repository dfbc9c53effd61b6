"""A stand-in SGLang server for contract tests (`python -m tests.integration.fake_sglang`).

SGLang cannot run on this CPU, so this server implements the part of its documented HTTP API the
rollout client and the weight sync use, with the same request and response fields, and checks
them as strictly as SGLang's request dataclasses do (a missing or unknown field is a 400). What
it does is real: it generates with a torch policy (log-probs included) and joins the trainer's
weight group over gloo exactly as SGLang's `init_weights_update_group` describes (rendezvous at
master_address:master_port, rank = rank_offset + tp_rank, store prefixed by group name), then
receives each `update_weights_from_distributed` call's broadcast, flattened or per tensor.

An MoE policy (a config with num_experts) serves `return_routed_experts` as SGLang does:
`meta_info.routed_experts` = base64 of an int32 array [prompt + output - 1, layers, top_k]
(models/routing_replay.py records them); a dense policy refuses the field, as a server
launched without `--enable-return-routed-experts` has nothing to return.

With `--api-key` it refuses (401) every request but /health* that lacks `Authorization: Bearer
<key>`, as SGLang's middleware does for a server started with that flag (sglang 0.5.23:
srt/utils/auth.py, decide_request_auth).

Test-only endpoints: `GET /relax_test/events` (what happened, in order: generate start/end with
the weight version, update begin/end, pause, continue) and `GET /relax_test/digest` (sha256 of
every parameter's bytes), so a test can check weights arrived bit-exact and that no generation
ran during an update.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch
import torch.distributed as dist

from relax_core.models.routing_replay import attach_routing_replay
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.sync.buckets import dtype_of
from relax_core.sync.process_group import join_weight_group, leave_weight_group

REQUIRED = {
    "/generate": (
        {"input_ids", "sampling_params"},
        {"return_logprob", "stream", "rid", "return_routed_experts"},
    ),
    "/init_weights_update_group": (
        {"master_address", "master_port", "rank_offset", "world_size"},
        {"group_name", "backend"},
    ),
    "/update_weights_from_distributed": (
        {"names", "dtypes", "shapes"},
        {"group_name", "flush_cache", "abort_all_requests", "weight_version", "load_format"},
    ),
    "/destroy_weights_update_group": (set(), {"group_name"}),
    "/pause_generation": (set(), {"mode"}),
    "/continue_generation": (set(), set()),
    "/flush_cache": (set(), set()),
    "/update_weights_from_disk": (
        {"model_path"},
        {"load_format", "abort_all_requests", "weight_version", "flush_cache", "keep_pause"},
    ),
    "/release_memory_occupation": (set(), {"tags"}),
    "/resume_memory_occupation": (set(), {"tags"}),
}
MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}
SAMPLING = {"max_new_tokens", "temperature", "top_p", "skip_special_tokens", "stop_token_ids"}


class BadRequest(Exception):
    pass


class FakeSGLang:
    def __init__(self, model, eos: int, pad: int, generate_delay_s: float) -> None:
        self.moe = bool(getattr(model.config, "num_experts", 0))
        if self.moe:
            attach_routing_replay(model)
        self.engine = TorchEngine(model, eos, pad, seed=0)
        self.model = model
        self.weight_version = "default"
        self.groups: dict[str, object] = {}
        self.events: list[list] = []
        self.cond = threading.Condition()
        self.paused = False
        self.running = 0
        self.waiting = 0
        self.model_lock = threading.Lock()
        self.generate_delay_s = generate_delay_s
        self.released: set[str] = set()
        """Memory tags released (colocate): generating needs none released, loading weights
        needs 'weights' held."""

    def event(self, *what) -> None:
        with self.cond:
            self.events.append([time.time(), *what])
            record = os.environ.get("RELAX_TEST_SGLANG_EVENTS")
            if record:  # a server started by the product under test outlives no assertion
                with open(record, "a") as f:
                    f.write(json.dumps([time.time(), *what]) + "\n")

    # ------------------------------------------------------------------ endpoints
    def generate(self, body: dict) -> list | dict:
        ids = body["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        prompts = [ids] if single else ids
        sp = body["sampling_params"]
        if body.get("return_routed_experts") and not self.moe:
            raise BadRequest("return_routed_experts: the served model has no MoE routers")
        unknown = set(sp) - SAMPLING
        if unknown:
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
        with self.cond:  # a paused server queues new requests (retract/in_place) until continue
            self.waiting += 1
            while self.paused:
                self.cond.wait()
            self.waiting -= 1
            self.running += 1
        try:
            with self.model_lock:
                version = self.weight_version
                self.event("generate_start", version)
                time.sleep(self.generate_delay_s)
                completions = self.engine.generate(prompts, params)
                self.event("generate_end", version)
        finally:
            with self.cond:
                self.running -= 1
                self.cond.notify_all()
        out = []
        for i, c in enumerate(completions):
            meta = {
                "id": f"req-{i}",
                "finish_reason": {"type": c.finish_reason},
                "prompt_tokens": len(prompts[i]),
                "completion_tokens": len(c.response_ids),
                "weight_version": version,
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

    def init_group(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return {"success": False, "message": f"group {name} already exists"}
        group = join_weight_group(
            body.get("backend", "nccl"),
            body["master_address"],
            int(body["master_port"]),
            int(body["world_size"]),
            int(body["rank_offset"]),  # tp_rank 0: this server has one TP rank
            name,
            120.0,
        )
        self.groups[name] = group
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        if name not in self.groups:
            return {"success": False, "message": f"Group {name} not in {list(self.groups)}"}
        names, dtypes, shapes = body["names"], body["dtypes"], body["shapes"]
        if not len(names) == len(dtypes) == len(shapes):
            raise BadRequest("names, dtypes and shapes differ in length")
        group = self.groups[name]
        # SGLang flushes the cache after loading, and a flush needs an idle scheduler: no running
        # request (paused in_place ones count), and no waiting one unless generation is paused
        # (Scheduler.flush_cache -> is_fully_idle(ignore_waiting=paused) in 0.5.23).
        flushable = self._idle_for_flush()
        self.event("update_begin", name)
        empties = [torch.empty(s, dtype=dtype_of(d)) for d, s in zip(dtypes, shapes, strict=True)]
        if body.get("load_format") == "flattened_bucket":
            flat = torch.empty(sum(t.nbytes for t in empties), dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=group)
            offset = 0
            for t in empties:
                t.view(-1).view(torch.uint8).copy_(flat[offset : offset + t.nbytes])
                offset += t.nbytes
        else:
            for t in empties:
                dist.broadcast(t, src=0, group=group)
        with self.model_lock:
            params = dict(self.model.named_parameters())
            missing = [n for n in names if n not in params]
            if missing:
                return {"success": False, "message": f"unknown parameters {missing}"}
            with torch.no_grad():
                for n, t in zip(names, empties, strict=True):
                    params[n].copy_(t)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        self.event("update_end", self.weight_version)
        if body.get("flush_cache", True) and not flushable:
            return {
                "success": False,
                "message": "Weights were updated, but the cache was not flushed because "
                "requests are still running or queued. Retract or finish them, then call "
                "/flush_cache.",
            }
        return {"success": True, "message": "Succeeded to update parameter online."}

    def _idle_for_flush(self) -> bool:
        with self.cond:
            return self.running == 0 and (self.paused or self.waiting == 0)

    def update_from_disk(self, body: dict) -> dict:
        from safetensors.torch import load_file

        path = body["model_path"]
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
        if not files:
            return {"success": False, "message": f"no *.safetensors in {path}"}
        if "weights" in self.released:
            return {"success": False, "message": "weights are released; resume them first"}
        self.event("update_begin", "disk")
        with self.model_lock:
            params = dict(self.model.named_parameters())
            loaded = {}
            for f in files:
                loaded.update(load_file(os.path.join(path, f)))
            unknown = sorted(set(loaded) - set(params))
            if unknown:
                return {"success": False, "message": f"unknown parameters {unknown}"}
            with torch.no_grad():
                for n, t in loaded.items():
                    params[n].copy_(t)
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        self.event("update_end", self.weight_version)
        return {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    def release(self, body: dict) -> dict:
        tags = set(body.get("tags") or MEMORY_TAGS)
        if tags - MEMORY_TAGS:
            raise BadRequest(f"unknown memory tags {sorted(tags - MEMORY_TAGS)}")
        with self.cond:
            if self.waiting or self.running:
                raise BadRequest("release_memory_occupation while requests run")
            self.released |= tags
        self.event("release", sorted(tags))
        return {"success": True, "message": "released"}

    def resume_memory(self, body: dict) -> dict:
        tags = set(body.get("tags") or MEMORY_TAGS)
        self.released -= tags
        self.event("resume_memory", sorted(tags))
        return {"success": True, "message": "resumed"}

    def destroy_group(self, body: dict) -> dict:
        group = self.groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return {"success": False, "message": "no such group"}
        leave_weight_group(group)
        return {"success": True, "message": "destroyed"}

    def pause(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"Invalid mode: {mode!r}")
        if mode == "in_place":
            # Running requests stay in the batch, paused, and go on after continue with the
            # KV cache they have: they are still running while the update arrives.
            with self.cond:
                self.paused = True
            self.event("pause", mode)
            return {"success": True, "message": "paused"}
        with self.cond:
            # Requests queued before this pause run first (SGLang serves a retracted request
            # after continue; here that is before the next pause, so a trainer that updates
            # many times a second cannot starve generation), then no generation overlaps the
            # update.
            while self.waiting or self.running:
                self.cond.wait()
            self.paused = True
        self.event("pause", mode)
        return {"success": True, "message": "paused"}

    def resume(self, body: dict) -> dict:
        with self.cond:
            self.paused = False
            self.cond.notify_all()
        self.event("continue")
        return {"success": True, "message": "continued"}

    def digest(self) -> dict:
        with self.model_lock:
            return {
                n: hashlib.sha256(
                    p.detach().contiguous().view(-1).view(torch.uint8).numpy()
                ).hexdigest()
                for n, p in self.model.named_parameters()
            }


def serve(state: FakeSGLang, port: int, api_key: str = "") -> ThreadingHTTPServer:
    posts = {
        "/generate": state.generate,
        "/init_weights_update_group": state.init_group,
        "/update_weights_from_distributed": state.update,
        "/destroy_weights_update_group": state.destroy_group,
        "/pause_generation": state.pause,
        "/continue_generation": state.resume,
        "/flush_cache": lambda body: {"success": True, "message": ""},
        "/update_weights_from_disk": state.update_from_disk,
        "/release_memory_occupation": state.release,
        "/resume_memory_occupation": state.resume_memory,
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
            gets = {
                "/health": lambda: None,
                "/get_model_info": lambda: {
                    "model_path": "fake",
                    "is_generation": True,
                    "weight_version": state.weight_version,
                },
                "/get_server_info": lambda: {"tp_size": 1, "dp_size": 1},
                "/relax_test/events": lambda: state.events,
                "/relax_test/digest": state.digest,
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
                if unknown := set(body) - required - optional:
                    raise BadRequest(f"unknown field(s) {sorted(unknown)}")
                self._send(200, posts[self.path](body))
            except (BadRequest, ValueError, KeyError, TypeError) as err:
                self._send(400, {"error": {"message": str(err)}})

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
    p.add_argument("--weight-version", default="default")
    p.add_argument("--api-key", default="")
    a = p.parse_args()
    torch.set_num_threads(1)
    if a.checkpoint:
        from relax_core.models.policy import load_policy

        model, tok = load_policy(a.checkpoint)
    else:
        from tests.integration.weight_sync_actors import tiny_policy

        model, tok = tiny_policy(a.tiny_seed)
    state = FakeSGLang(model, tok.eos_token_id, tok.pad_token_id, a.generate_delay_s)
    state.weight_version = a.weight_version
    serve(state, a.port, a.api_key).serve_forever()


if __name__ == "__main__":
    main()
