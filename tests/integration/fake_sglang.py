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
  `abort` (TokenizerManager.pause_generation: abort_request(abort_all=True), repeated until
  no request holds the model) ends every request at once: a running one answers the tokens it
  has with `finish_reason {"type": "abort", "message": "Aborted"}` (FINISH_ABORT), a waiting
  one answers none ("Abort in waiting queue": _handle_abort_req); the call returns once none
  is left; requests that arrive while paused wait for continue (is_pause_cond);
- `/health` and `/health_generate` run a one-token generation and answer no sooner than a
  second (health_generate sleeps 1 s before it looks for an answer; `--health-s` here), 503
  when none came, as while paused; `/ready` answers at once: 200 when warmed up and not paused
  (TokenizerManager.is_ready), else 503;
- a prompt of `context_len` tokens or more, or a prompt plus `max_new_tokens` over it, refuses
  the whole `/generate` call with HTTP 400 and SGLang's text
  (TokenizerManager._validate_one_request); context_len is `--context-length`, else the
  model's `max_position_embeddings` (hf_transformers/common.get_context_length);
- `/get_model_info` and `/get_server_info` answer as `/model_info` and `/server_info` and log
  a deprecation WARNING on every call (recorded as a `deprecated` event here);
- the prefix cache and `/flush_cache`: fake_sglang_cache.py;
- an MoE policy serves `return_routed_experts` (base64 int32 [prompt + output - 1, layers,
  top_k]); a dense one refuses it, as a server without `--enable-return-routed-experts`;
- with `--api-key` every request but /health* needs `Authorization: Bearer <key>`
  (srt/utils/auth.py, decide_request_auth).

LoRA (`--enable-lora`, adapters loaded by name, `lora_path` on /generate, `GET /v1/models`) is
fake_sglang_lora.py, with the rules it copies.

Test-only endpoints: `GET /relax_test/events` (generate start/end with the weight version, retract,
update begin/end, pause, continue, abort, flush, stale_kv, deprecated), `GET /relax_test/digest`
(sha256 of every parameter's bytes), `GET /relax_test/loaded` (every weight name sent: consumed
or ignored by load_weights) and `GET /relax_test/pid` (the process serving the port: a test
kills it to restart the server, fake_sglang_fleet.py).
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

import numpy as np
import torch

from relax_core.models.routing_replay import attach_routing_replay
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from tests.integration.fake_sglang_cache import Flusher, PrefixCache
from tests.integration.fake_sglang_fleet import run_fleet
from tests.integration.fake_sglang_http import BadRequest, serve
from tests.integration.fake_sglang_lora import FakeLoRA
from tests.integration.fake_sglang_weights import FakeWeights

MEMORY_TAGS = {"weights", "kv_cache", "cuda_graph"}
SAMPLING = {"max_new_tokens", "temperature", "top_p", "skip_special_tokens", "stop_token_ids"}


def aborted(body: dict, version: str) -> dict:
    """The answer of a request aborted in the waiting queue (TokenizerManager._handle_abort_req)."""
    meta = {
        "id": "aborted",
        "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
        "weight_version": version,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}


def _answers(single: bool, out: list) -> list | dict:
    return out[0] if single else out


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
        context_length: int | None = None,
        health_s: float = 1.0,
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
        self.context_arg = context_length
        """--context-length as launched (None: the model's)."""
        self.context_len = context_length or int(model.config.max_position_embeddings)
        self.health_s = health_s
        self.aborts = 0
        """Abort-all rounds so far: a request admitted before the latest one is aborted."""
        self.cache = PrefixCache()
        self.flusher = Flusher(self)

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
        if self.local.epoch != self.aborts:  # aborted: the answer ends at the tokens it has
            if self.local.cut is None:
                self.local.cut = self.local.tokens
                self.event("abort", self.local.tokens)
            return False
        time.sleep(self.step_delay_s)
        with self.cond:
            mode = self.paused
            if mode in ("", "abort"):
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
        with self.cond:  # TokenizerManager: requests wait here while paused, then validate
            while self.paused:
                self.cond.wait()
        for prompt in prompts:
            self._validate(len(prompt), params.max_new_tokens)
        adapters = self.lora.acquire(body.get("lora_path"), len(prompts))
        self.local.tokens, self.local.retractions, self.local.cut = 0, 0, None
        try:
            if not self._admit():
                return _answers(single, [aborted(body, self.weight_version)] * len(prompts))
            try:
                self.event("generate_start", self.weight_version)
                if any(adapters):
                    self.event("lora_generate", sorted({a.name for a in adapters if a}))
                cached = [self._cached(p, a) for p, a in zip(prompts, adapters, strict=True)]
                first = self.weight_version
                time.sleep(self.generate_delay_s)
                completions = self._generate_with(prompts, params, adapters)
                version = self.weight_version
                for prompt, c, adapter in zip(prompts, completions, adapters, strict=True):
                    if not adapter:  # a finished request leaves its tokens in the cache
                        self.cache.insert(prompt + c.response_ids, first)
                self.event("generate_end", version)
            finally:
                with self.cond:
                    self.running -= 1
                    self._give_model()
                    self.flusher.check_pending()
        finally:
            self.lora.release(adapters)
        out = [
            self._answer(body, c, len(prompts[i]), cached[i], version, i)
            for i, c in enumerate(completions)
        ]
        return _answers(single, out)

    def _validate(self, input_tokens: int, max_new_tokens: int) -> None:
        """SGLang's context checks (TokenizerManager._validate_one_request), its words."""
        if input_tokens >= self.context_len:
            raise BadRequest(
                f"The input ({input_tokens} tokens) is longer than the model's context "
                f"length ({self.context_len} tokens)."
            )
        total = input_tokens + max_new_tokens
        if total > self.context_len:
            raise BadRequest(
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {total} tokens: "
                f"{input_tokens} tokens from the input messages and {max_new_tokens} tokens "
                "for the completion. Please reduce the number of tokens in the input messages "
                "or the completion to fit within the limit."
            )

    def _admit(self) -> bool:
        """Queue until the model is free and take it; False when an abort-all came first."""
        with self.cond:
            self.local.epoch = self.aborts
            self.waiting += 1
            while (self.paused or self.busy) and self.local.epoch == self.aborts:
                self.cond.wait()
            if self.local.epoch != self.aborts:
                self.waiting -= 1
                self.cond.notify_all()
                return False
            self.busy = True
            self.waiting, self.running = self.waiting - 1, self.running + 1
            return True

    def _cached(self, prompt: list[int], adapter) -> int:
        """Prompt tokens served from the prefix cache; KV of other weights is recorded."""
        if adapter:
            return 0
        tokens, version = self.cache.match(prompt)
        if tokens and version != self.weight_version:
            self.event("stale_kv", tokens, version, self.weight_version)
        return tokens

    def _answer(self, body: dict, c, prompt_len: int, cached: int, version: str, i: int) -> dict:
        ids, logprobs, experts = c.response_ids, c.logprobs, c.routed_experts
        finish = {"type": c.finish_reason}
        cut = self.local.cut
        if cut is not None and len(ids) > cut:  # aborted mid-way: the tokens it had
            ids, logprobs = ids[:cut], logprobs[:cut]
            experts = experts[: prompt_len + cut - 1] if experts is not None else None
            finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        meta = {
            "id": f"req-{i}",
            "finish_reason": finish,
            "prompt_tokens": prompt_len,
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "weight_version": version,
            "num_retractions": self.local.retractions,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [
                [lp, t, None] for lp, t in zip(logprobs, ids, strict=True)
            ]
        if body.get("return_routed_experts"):
            meta["routed_experts"] = base64.b64encode(
                np.asarray(experts, dtype=np.int32).tobytes()
            ).decode("utf-8")
        return {"text": "", "output_ids": ids, "meta_info": meta}

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
            if mode == "abort":  # every request ends now, with what it has
                self.aborts += 1
                self.cond.notify_all()
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
            if "kv_cache" in tags:
                self.cache.reset()
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
        return {
            "tp_size": self.tp_size,
            "dp_size": self.dp_size,
            "pp_size": 1,
            "context_length": self.context_arg,
            "max_req_input_len": self.context_len - 6,
            "version": "0.5.23",
        }

    def digest(self) -> dict:
        with self.model_held():
            return {
                n: hashlib.sha256(
                    p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
                ).hexdigest()
                for n, p in self.model.named_parameters()
            }


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
    p.add_argument("--context-length", type=int, help="else: the model's")
    p.add_argument("--health-s", type=float, default=1.0, help="how long /health takes")
    p.add_argument("--more-ports", type=int, nargs="*", help="a server on each (forked)")
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
    model = model.to(a.device)

    def serve_one(port: int) -> None:
        state = FakeSGLang(
            model,
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
            context_length=a.context_length,
            health_s=a.health_s,
        )
        state.weight_version = a.weight_version
        state.served_model = a.checkpoint or "fake"
        serve(state, port, a.api_key).serve_forever()

    if a.more_ports:
        run_fleet([a.port, *a.more_ports], serve_one)
    serve_one(a.port)


if __name__ == "__main__":
    main()
