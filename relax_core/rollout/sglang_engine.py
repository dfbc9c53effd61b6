"""SGLang rollout engine: a `RolloutEngine` that talks to an SGLang server over its HTTP API.

SGLang pins its own torch and transformers, so it runs in its own image (containers/) or venv and
this side only speaks HTTP:
- `POST /generate` with `input_ids` (a batch), `sampling_params` and `return_logprob`; each
  answer carries `output_ids`, `meta_info.output_token_logprobs` ([logprob, token_id, text]),
  `meta_info.finish_reason.type` ('stop', 'length', 'abort') and `meta_info.weight_version`.
  With `return_routed_experts` (a server launched with `--enable-return-routed-experts`; routing
  replay of an MoE policy), `meta_info.routed_experts` is base64 of an int32 array
  [len(prompt) + len(output) - 1, num_hidden_layers, num_experts_per_tok], C order: the experts
  every token but the last was routed to (SGLang: layers/moe/routed_experts_capturer.py reads
  `seqlen - 1` tokens; managers/detokenizer_manager.py encodes `.numpy().tobytes()`).
- `GET /model_info` (weight_version) and `GET /server_info` (tp_size, dp_size, context_length);
  0.5.23 still answers `/get_model_info` and `/get_server_info` but logs a deprecation WARNING
  on every call, and the rollout polls the version every 20 ms. `GET /health` runs a one-token
  generation (a second at least, 503 while paused): a liveness check reads `/model_info`, a
  wait for start-up polls `/ready`.
- `POST /pause_generation {"mode"}`, `POST /continue_generation`, `POST /flush_cache`,
  `POST /release_memory_occupation` / `/resume_memory_occupation` (colocate on one GPU).
- Weights reach the server through the trainer's own process group (sync/sglang.py drives
  `/init_weights_update_group` and `/update_weights_from_distributed`); `update_weights` here
  refuses, naming that path.
- A LoRA policy (`lora=True`): the server holds the frozen base, and each policy version is an
  adapter loaded by name, `policy-v{N}` (rollout/sglang_lora.py). `GET /v1/models` lists the
  loaded adapters; the engine serves the newest, passing its name as `lora_path`, and that name
  is the version of everything the request generates (the server's weight_version is the base's).

A `/generate` call is all or nothing: one prompt whose length plus `max_new_tokens` passes the
server's context refuses the whole batch, so the engine refuses such a batch before sending it,
naming `rollout.max_new_tokens` and the context. A completion cut by an abort (`pause_mode:
abort` answers every running request with the tokens it had, finish_reason 'abort') is never
returned as a sample: the engine asks for it again, as the vLLM engine does. The socket waits
for a whole generation, so its timeout grows with the tokens asked for.

The policy version of a completion: the server reports the weight version that ended it; the
version the engine held when the request went out is its first token's. When they differ, a
weight update landed mid-generation (paused in place) and the completion says so through
`policy_version_max`, as a partial rollout of the torch engine does.

sglang_server.py starts the server (or finds a running one) for a rollout worker.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from relax_core.rollout.engine import (
    MAX_ABORT_RETRIES,
    Completion,
    SamplingParams,
    without_aborts,
)
from relax_core.rollout.server_client import ServerClient
from relax_core.rollout.server_client import ServerError as SGLangError

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
MIN_TOKENS_PER_S = 50.0
"""A floor on a server's decode rate over a whole batch: a `/generate` call is given the client's
timeout plus its tokens at this rate before its socket gives up."""
API_KEY_ENV = "RELAX_SGLANG_API_KEY"
ADAPTER_PREFIX = "policy-v"
"""A LoRA policy's version N is the adapter named `policy-v{N}` on a server (an adapter name
is loaded once: each version gets its own)."""


def adapter_name(version: int) -> str:
    return f"{ADAPTER_PREFIX}{version}"


def adapter_version(name: str) -> int | None:
    """N of an adapter named `policy-v{N}`; None for any other adapter."""
    digits = name[len(ADAPTER_PREFIX) :] if name.startswith(ADAPTER_PREFIX) else ""
    return int(digits) if digits.isdigit() else None


class SGLangClient(ServerClient):
    """JSON over HTTP to one SGLang server.

    A server started with `--api-key` (the rollout pod's sidecar on a cluster) answers nothing
    but /health without it; the key comes from $RELAX_SGLANG_API_KEY, which the rollout and
    trainer pods get from the run's Kubernetes secret (tasks/pods.py)."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
        super().__init__(url, timeout_s, key)


def parse_version(value: Any) -> int | None:
    """Our policy versions are integers; a server still on its launch weights says 'default'."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


class SGLangEngine:
    """A `RolloutEngine` backed by one SGLang server (any tensor-parallel size)."""

    def __init__(
        self,
        client: SGLangClient,
        pause_mode: str = "in_place",
        routed_experts: bool = False,
        lora: bool = False,
        context_len: int | None = None,
    ) -> None:
        if pause_mode not in ("abort", "retract", "in_place"):
            raise ValueError(
                f"pause_mode must be 'abort', 'retract' or 'in_place', got {pause_mode!r}"
            )
        self.client = client
        self.pause_mode = pause_mode
        self.routed_experts = routed_experts
        """Ask for each completion's routed experts (routing replay of an MoE policy)."""
        self.lora = lora
        """The policy is a LoRA adapter on the server's base (see the module doc)."""
        self.version = -1
        """The newest policy version the server reported (-1: still its launch weights)."""
        self.adapter: str | None = None
        """LoRA: the adapter requests name (`policy-v{version}`); None until one is loaded."""
        self._context = context_len
        """Tokens a request may hold, prompt and output (None: ask the server)."""
        self._context_asked = False
        self.aborted_retries = 0
        """Samples asked for again after an abort, over this engine's life."""

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        if media is not None:
            raise ValueError(
                "the SGLang engine takes text prompts here; media goes to it as image_data/"
                "audio_data, which the omni rollout path does not send yet"
            )
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self._check_context(prompts, params)
        out, again = without_aborts(
            len(prompts),
            lambda todo: self._generate_once([prompts[i] for i in todo], params),
            lambda left: SGLangError(
                f"{self.client.url}: {left} samples aborted {MAX_ABORT_RETRIES + 1} times in a "
                "row; is the server being paused with mode 'abort' without end?"
            ),
        )
        self.aborted_retries += again
        return out

    def _generate_once(self, prompts: list[list[int]], params: SamplingParams) -> list:
        first = self.version
        body = {
            "input_ids": prompts,
            "sampling_params": sampling_body(params),
            "return_logprob": True,
        }
        if self.routed_experts:
            body["return_routed_experts"] = True
        if self.lora:
            body["lora_path"] = self._adapter_to_serve()
            first = self.version  # the adapter's
        timeout = self.client.timeout_s + len(prompts) * params.max_new_tokens / MIN_TOKENS_PER_S
        try:
            answers = self.client.post("/generate", body, timeout_s=timeout)
        except SGLangError as err:
            if "context length" in str(err):
                raise SGLangError(
                    f"rollout.max_new_tokens {params.max_new_tokens} plus a prompt of "
                    f"{max(len(p) for p in prompts)} tokens does not fit the model's context: "
                    f"{err}"
                ) from err
            if not self.lora or body["lora_path"] not in str(err):
                raise
            # The trainer unloaded this adapter after we chose it (it moved on): SGLang refuses
            # a request naming it before generating anything, so ask again with the newest.
            self.refresh_version()
            if self.adapter == body["lora_path"]:
                raise
            return self._generate_once(prompts, params)
        if isinstance(answers, dict):
            answers = [answers]
        if not isinstance(answers, list) or len(answers) != len(prompts):
            got = len(answers) if isinstance(answers, list) else type(answers).__name__
            raise SGLangError(
                f"{self.client.url}/generate answered {got} results for {len(prompts)} prompts"
            )
        return [self._completion(a, first, i, len(prompts[i])) for i, a in enumerate(answers)]

    def context(self) -> int | None:
        """Tokens one request may hold (prompt + output): as given, else the server's
        `--context-length` (`/server_info`); None when neither says (or the server does not
        answer: then `/generate` says why)."""
        if self._context is None and not self._context_asked:
            try:
                info = self.client.get("/server_info")
            except SGLangError:
                return None
            self._context_asked = True
            value = info.get("context_length") if isinstance(info, dict) else None
            self._context = int(value) if isinstance(value, int) and value > 0 else None
        return self._context

    def _check_context(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """SGLang refuses a whole `/generate` call when one prompt plus max_new_tokens passes
        its context: refuse it here, before sending, naming the setting."""
        longest = max(len(p) for p in prompts)
        context = self.context()
        if context is not None and longest + params.max_new_tokens > context:
            raise SGLangError(
                f"a prompt of {longest} tokens plus rollout.max_new_tokens "
                f"{params.max_new_tokens} does not fit the model's context of {context} tokens "
                f"({self.client.url}): SGLang refuses the whole batch; lower "
                "rollout.max_new_tokens, shorten the prompts, or serve a longer context "
                "(--context-length in sglang.extra_args, where the model allows it)"
            )

    def _completion(self, answer: Any, first: int, i: int, prompt_len: int) -> Completion:
        try:
            meta = answer["meta_info"]
            pairs = meta["output_token_logprobs"]
            ids = [int(p[1]) for p in pairs]
            logprobs = [float(p[0]) for p in pairs]
            finish = meta["finish_reason"]
            kind = finish["type"] if isinstance(finish, dict) else str(finish)
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise SGLangError(
                f"{self.client.url}/generate result {i} lacks output_token_logprobs or "
                f"finish_reason ({type(err).__name__}: {err}); was return_logprob honoured?"
            ) from err
        if "output_ids" in answer and list(answer["output_ids"]) != ids:
            raise SGLangError(
                f"{self.client.url}/generate result {i}: output_ids and the token ids of "
                "output_token_logprobs differ"
            )
        # A LoRA request runs on its adapter alone; the server's weight_version is the base's.
        served = None if self.lora else parse_version(meta.get("weight_version"))
        last = served if served is not None else first
        self.version = max(self.version, last)
        start = first if first >= 0 else last
        experts = None
        if self.routed_experts:
            where = f"{self.client.url}/generate result {i}"
            experts = parse_routed_experts(meta, prompt_len + len(ids) - 1, where)
        return Completion(
            response_ids=ids,
            logprobs=logprobs,
            finish_reason=_FINISH.get(kind, "abort"),
            policy_version=start,
            policy_version_max=last if last != start else None,
            routed_experts=experts,
        )

    def refresh_version(self) -> int:
        """Ask the server which weights it serves (LoRA: its newest policy adapter); updates
        and returns `version`."""
        if self.lora:
            held = served_adapters(self.client)
            if held:
                self.use_adapter(max(held))
            return self.version
        info = self.client.get("/model_info")
        served = parse_version(info.get("weight_version") if isinstance(info, dict) else None)
        if served is not None:
            self.version = served
        return self.version

    def use_adapter(self, version: int) -> None:
        """LoRA: serve adapter `policy-v{version}` from now on."""
        self.version, self.adapter = version, adapter_name(version)

    def _adapter_to_serve(self) -> str:
        if self.adapter is None:
            self.refresh_version()
        if self.adapter is None:
            raise SGLangError(
                f"{self.client.url} holds no adapter of the LoRA policy ({ADAPTER_PREFIX}N in "
                "GET /v1/models): its base alone is not the policy"
            )
        return self.adapter

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        raise NotImplementedError(
            "an SGLang server receives weights from the trainer's process group "
            "(sync/sglang.py: /update_weights_from_distributed), not through its rollout client"
        )

    def pause(self) -> None:
        self.client.post("/pause_generation", {"mode": self.pause_mode})

    def resume(self) -> None:
        self.client.post("/continue_generation", {})

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Colocate on one GPU: free weights and KV cache while the trainer runs."""
        self.client.post_ok("/release_memory_occupation", {"tags": list(tags) if tags else None})

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        self.client.post_ok("/resume_memory_occupation", {"tags": list(tags) if tags else None})

    def health(self) -> dict[str, object]:
        """Alive when the server answers `/model_info` (SGLang's /health generates a token: a
        second at least, and 503 while paused for a weight update)."""
        try:
            version = self.refresh_version()
        except SGLangError as err:
            return {"alive": False, "url": self.client.url, "error": str(err)}
        return {"alive": True, "url": self.client.url, "policy_version": version}

    def parallel_shape(self) -> tuple[int, int]:
        """(tensor-parallel ranks, data-parallel replicas) of the server."""
        info = self.client.get("/server_info")
        try:
            return int(info.get("tp_size", 1)), int(info.get("dp_size", 1))
        except (AttributeError, TypeError, ValueError) as err:
            raise SGLangError(
                f"{self.client.url}/server_info has no usable tp_size/dp_size"
            ) from err


def served_adapters(client: SGLangClient) -> dict[int, str]:
    """The policy adapters a server holds, {version: name}, from `GET /v1/models` (the base
    model's card, then one per loaded adapter: `id` its name, `parent` the base)."""
    listing = client.get("/v1/models")
    try:
        cards = [card["id"] for card in listing["data"] if card.get("parent")]
    except (KeyError, TypeError) as err:
        raise SGLangError(f"{client.url}/v1/models: no model list ({listing!r:.200})") from err
    held = {adapter_version(str(name)): str(name) for name in cards}
    return {v: name for v, name in held.items() if v is not None}


def parse_routed_experts(meta: dict[str, Any], num_tokens: int, where: str) -> list[list[int]]:
    """`meta_info.routed_experts` (base64 of int32 [num_tokens, layers, top_k]) as one list of
    layers * top_k ints per token; SGLangError naming the field when absent or malformed."""
    value = meta.get("routed_experts")
    if not isinstance(value, str):
        raise SGLangError(
            f"{where} has no meta_info.routed_experts (got {type(value).__name__}); start the "
            "server with --enable-return-routed-experts for routing replay"
        )
    try:
        flat = np.frombuffer(base64.b64decode(value, validate=True), dtype="<i4")
    except (binascii.Error, ValueError) as err:
        raise SGLangError(f"{where}: meta_info.routed_experts is not base64 int32 ({err})") from err
    if num_tokens <= 0:
        return []
    if flat.size == 0 or flat.size % num_tokens:
        raise SGLangError(
            f"{where}: meta_info.routed_experts holds {flat.size} ints, not a whole number per "
            f"token for {num_tokens} tokens (prompt + output - 1)"
        )
    return flat.reshape(num_tokens, -1).tolist()


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters in SGLang's words. Greedy is temperature 0; EOS is never
    ignored and special tokens stay in the ids (the rollout role detokenizes)."""
    return {
        "max_new_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": 1.0 if params.greedy else params.top_p,
        "skip_special_tokens": False,
    }
