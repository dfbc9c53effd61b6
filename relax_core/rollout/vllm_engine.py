"""vLLM rollout engine: a `RolloutEngine` that talks to a vLLM 0.32 server over HTTP.

vLLM pins its own transformers, so it runs in its own environment (scripts/vllm_env.sh, or the
rollout image) and this side only speaks HTTP:
- `POST /inference/v1/generate` (the token-in/token-out API, a server started with
  `--enable-scale-out`), one request per prompt, sent together so the server batches them:
  `{token_ids, sampling_params: {max_tokens, temperature, top_p, logprobs: 0, detokenize:
  false, skip_special_tokens: false}}`. Its one choice carries `token_ids`, `logprobs.content`
  ([{token_id, logprob}] of each sampled token under the sampling distribution),
  `finish_reason` ('stop', 'length', 'abort') and `weight_versions`: spans of output tokens and
  the weight version that sampled them (`/finish_weight_update {weight_version}` labels them).
- the RL API (a server started with VLLM_SERVER_DEV_MODE=1): `POST /pause?mode=` (abort, wait,
  keep), `/resume`, `GET /is_paused`, `GET /weight_info`, `POST /update_weight_version`,
  `POST /reset_prefix_cache`, `GET /get_world_size`. The trainer's weight transfer goes
  through the same API (sync/vllm.py).

A completion's versions come from its spans: the first span's version sampled its first token,
the last span's its last (a `keep` pause lands an update mid-generation: a partial rollout). A
completion cut by an abort (`pause_mode: abort`, a server draining) is never returned as a
sample: the engine asks for it again, so no prompt is lost and no cut sample is trained.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relax_core.config.services import VLLM_PAUSE_MODES as PAUSE_MODES
from relax_core.rollout.engine import (
    MAX_ABORT_RETRIES,
    Completion,
    SamplingParams,
    without_aborts,
)
from relax_core.rollout.server_client import ServerClient, ServerError
from relax_core.rollout.sglang_engine import adapter_version, parse_version, served_adapters

log = logging.getLogger(__name__)
RL_API_HINT = (
    "start it with VLLM_SERVER_DEV_MODE=1 (the RL API: /pause, /resume, weight transfer) and "
    "--enable-scale-out (/inference/v1/generate)"
)


class VLLMError(ServerError):
    """A vLLM server refused a request, answered something unreadable, or is unreachable."""


class VLLMEngine:
    """A `RolloutEngine` backed by one vLLM server (any tensor-parallel size)."""

    def __init__(
        self,
        client: ServerClient,
        pause_mode: str = "wait",
        concurrency: int = 64,
        lora: bool = False,
    ) -> None:
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"vllm.pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.client = client
        self.pause_mode = pause_mode
        self.version = -1
        """The newest policy version the server reported (-1: still its launch weights)."""
        self.lora = lora
        """The policy is a LoRA adapter on the server's base: requests name the newest,
        `policy-v{N}` (vllm_lora.py), and that is the version of all they generate."""
        self.adapter: str | None = None
        self._context: int | None = None
        self.aborted_retries = 0
        """Samples asked for again after an abort, over this engine's life."""
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="vllm-gen")

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, media: list | None = None
    ) -> list[Completion]:
        if media is not None:
            raise ValueError("the vLLM engine takes text prompts; media is not sent to it")
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        self._check_context(prompts, params)

        def attempt(todo: list[int]) -> list[Completion]:
            adapter = self._adapter_to_serve() if self.lora else None
            first = self.version
            futures = [(i, self._pool.submit(self._one, prompts[i], params, adapter)) for i in todo]
            return [self._completion(future.result(), first, i) for i, future in futures]

        out, again = without_aborts(len(prompts), attempt, self._aborted_too_often)
        self.aborted_retries += again
        return out

    def _aborted_too_often(self, left: int) -> VLLMError:
        return VLLMError(
            f"{self.client.url}: {left} samples aborted {MAX_ABORT_RETRIES + 1} times in a "
            "row; is the server draining or being paused with mode 'abort' without end?"
        )

    def context(self) -> int:
        """The server's context per request (its max_model_len, from GET /v1/models)."""
        if self._context is None:
            listing = self.client.get("/v1/models")
            try:
                self._context = int(listing["data"][0]["max_model_len"])
            except (KeyError, IndexError, TypeError, ValueError) as err:
                raise VLLMError(f"{self.client.url}/v1/models: no max_model_len") from err
        return self._context

    def _check_context(self, prompts: list[list[int]], params: SamplingParams) -> None:
        """vLLM shortens a request whose prompt plus max_tokens passes its context, without a
        word: the sample ends 'length' before its budget, a truncation the run never asked for.
        Such a batch is refused whole, before anything generates."""
        longest = max(len(p) for p in prompts)
        if longest + params.max_new_tokens > self.context():
            raise VLLMError(
                f"a prompt of {longest} tokens plus rollout.max_new_tokens "
                f"{params.max_new_tokens} does not fit the vLLM server's context of "
                f"{self.context()} tokens (vllm.max_model_len): vLLM would cut the sample short "
                "without saying so; shorten the prompts or raise vllm.max_model_len"
            )

    def _one(self, prompt: list[int], params: SamplingParams, adapter: str | None) -> Any:
        body: dict[str, Any] = {"token_ids": prompt, "sampling_params": sampling_body(params)}
        if adapter is not None:
            body["model"] = adapter
        for _ in range(MAX_ABORT_RETRIES + 1):
            try:
                return self.client.post("/inference/v1/generate", body)
            except ServerError as err:
                if adapter is None or "HTTP 404" not in str(err):
                    raise VLLMError(f"vLLM generation failed: {err}") from err
                # The trainer unloaded this adapter after we chose it (it moved on): vLLM
                # refuses a request naming it before generating anything; ask the newest.
                self.refresh_version()
                if self.adapter == adapter:
                    raise VLLMError(f"vLLM generation failed: {err}") from err
                adapter = body["model"] = self.adapter
        raise VLLMError(f"{self.client.url}: the adapter moved on {MAX_ABORT_RETRIES} times")

    def _completion(self, answer: Any, first: int, i: int) -> Completion:
        where = f"{self.client.url}/inference/v1/generate (prompt {i})"
        try:
            choice = answer["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            content = (choice.get("logprobs") or {}).get("content") or []
            logprobs = [float(c["logprob"]) for c in content]
            sampled = [int(c["token_id"]) for c in content]
            finish = str(choice.get("finish_reason") or "abort")
            spans = choice.get("weight_versions") or []
        except (KeyError, TypeError, IndexError, ValueError) as err:
            raise VLLMError(
                f"{where}: no choice with token_ids and logprobs ({type(err).__name__}: {err})"
            ) from err
        if finish != "abort" and sampled != ids:
            raise VLLMError(
                f"{where}: the logprobs' token ids differ from token_ids; was logprobs: 0 honoured?"
            )
        versions = [
            parse_version(s.get("version")) for s in spans if s.get("end", 0) > s.get("start", 0)
        ]
        versions = [v for v in versions if v is not None]
        if self.lora:  # the spans label the base; the adapter named is the version
            versions = [adapter_version(str(answer.get("model", "")))]
            versions = [v for v in versions if v is not None]
        start = versions[0] if versions else first
        last = versions[-1] if versions else start
        self.version = max(self.version, last)
        return Completion(
            response_ids=ids,
            logprobs=logprobs,
            finish_reason=finish if finish in ("stop", "length") else "abort",
            policy_version=start,
            policy_version_max=last if last != start else None,
        )

    def refresh_version(self) -> int:
        """Ask the server which weights it serves (LoRA: its newest policy adapter); updates
        and returns `version`."""
        if self.lora:
            held = served_adapters(self.client)
            if held:
                self.version, self.adapter = max(held), held[max(held)]
            return self.version
        info = self.client.get("/weight_info")
        served = parse_version(info.get("weight_version") if isinstance(info, dict) else None)
        if served is not None:
            self.version = served
        return self.version

    def _adapter_to_serve(self) -> str:
        if self.adapter is None:
            self.refresh_version()
        if self.adapter is None:
            raise VLLMError(
                f"{self.client.url} holds no adapter of the LoRA policy (policy-vN in "
                "GET /v1/models): its base alone is not the policy"
            )
        return self.adapter

    def update_weights(self, named_tensors: Any, version: int) -> None:
        raise NotImplementedError(
            "a vLLM server receives weights from the trainer through its weight-transfer API "
            "(sync/vllm.py), not through its rollout client"
        )

    def pause(self) -> None:
        self.client.post(f"/pause?mode={self.pause_mode}")

    def resume(self) -> None:
        self.client.post("/resume")

    def health(self) -> dict[str, object]:
        try:
            self.client.get("/health", timeout_s=10.0)
            version = self.refresh_version()
        except ServerError as err:
            return {"alive": False, "url": self.client.url, "error": str(err)}
        return {"alive": True, "url": self.client.url, "policy_version": version}

    def parallel_shape(self) -> tuple[int, int]:
        """(tensor x pipeline-parallel ranks of one replica, data-parallel replicas)."""
        one = self.client.get("/get_world_size?include_dp=false")
        every = self.client.get("/get_world_size?include_dp=true")
        try:
            ranks, total = int(one["world_size"]), int(every["world_size"])
        except (KeyError, TypeError, ValueError) as err:
            raise VLLMError(f"{self.client.url}/get_world_size: no world_size ({one!r})") from err
        return ranks, max(1, total // max(1, ranks))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def sampling_body(params: SamplingParams) -> dict[str, Any]:
    """Our sampling parameters in vLLM's words: the sampled token's log-prob (logprobs 0), no
    detokenizing (the rollout role holds the tokenizer), EOS never ignored."""
    return {
        "max_tokens": params.max_new_tokens,
        "temperature": 0.0 if params.greedy else params.temperature,
        "top_p": 1.0 if params.greedy else params.top_p,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def require_rl_api(client: ServerClient) -> None:
    """VLLMError naming the flags when the server lacks the RL API or token generation."""
    try:
        client.get("/is_paused", timeout_s=30.0)
    except ServerError as err:
        raise VLLMError(
            f"vLLM server {client.url} has no RL API (GET /is_paused: {err}); {RL_API_HINT}"
        ) from err
    try:
        client.post(
            "/inference/v1/generate", {"token_ids": [0], "sampling_params": {"max_tokens": 1}}
        )
    except ServerError as err:
        raise VLLMError(
            f"vLLM server {client.url} refuses /inference/v1/generate ({err}); {RL_API_HINT}"
        ) from err


def served_engine(url: str, cfg: Any) -> VLLMEngine:
    """The engine a rollout worker drives a vLLM server at `url` through."""
    client = ServerClient(url, timeout_s=cfg.services.start_timeout_s)
    engine = VLLMEngine(client, cfg.vllm.pause_mode, lora=cfg.train.lora.rank > 0)
    log.info("driving the vLLM server at %s", url)
    return engine
