"""Value checks of a RunSections that need no I/O: ranges, allowed choices, and combinations of
settings that make no sense. Every message names the dotted field path and what is allowed.

Imported by config.py (which calls `validate` when it builds a config); imports nothing of it at
run time, so the two modules do not depend on each other in a cycle.
"""

from __future__ import annotations

import re

from relax_core.config.checks_algorithm import check_algorithm
from relax_core.config.checks_gpu import check_gpu_stacks
from relax_core.config.checks_sglang import check_sglang_context
from relax_core.config.checks_sglang_lora import check_sglang_lora
from relax_core.config.checks_source import MODEL_URI as MODEL_URI  # tracking/registry.py's
from relax_core.config.checks_source import source_form_problems
from relax_core.config.rules import choice, positive
from relax_core.config.sections import RewardConfig, RunSections

MODES = ("colocate", "async")
LAUNCHES = ("processes", "tasks")
WEIGHT_SYNCS = ("broadcast", "object_store")
SYNC_BACKENDS = ("auto", "gloo", "nccl")
RETENTIONS = ("prune", "keep")
"""queue.retention: delete what every kept checkpoint is past, or keep every entry."""
QWEN_MULTIMODAL = ("qwen2.5-vl", "qwen3-vl", "qwen2.5-omni", "qwen3-omni")
"""Qwen multimodal models from transformers (multimodal/qwen/families.py)."""
MODEL_KINDS = ("tiny-qwen3", "tiny-omni", "pretrained", *QWEN_MULTIMODAL)
MODALITIES = {
    "tiny-qwen3": (),
    "pretrained": (),
    "tiny-omni": ("image", "audio", "video"),
    "qwen2.5-vl": ("image", "video"),
    "qwen3-vl": ("image", "video"),
    "qwen2.5-omni": ("image", "video", "audio"),
    "qwen3-omni": ("image", "video", "audio"),
}
"""The media kinds a policy of each model.kind reads."""
TEMPLATES = ("plain", "chat")
DTYPES = ("float32", "bfloat16")
MATMUL_DTYPES = ("", "bfloat16", "auto")
ENGINES = ("torch", "sglang", "vllm")
SERVER_ENGINES = ("sglang", "vllm")
"""Engines that are servers of their own, driven over HTTP and sent weights through their API."""
TINY_POSITIONS = 512
"""Positions of the tiny models (models/tiny.py): prompt + response must fit."""
TOOL_PARSERS = ("hermes", "llama3_json", "none")
"""env.tool_parser's choices (agents/toolcalls.py has a parser for each)."""
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def judge_problems(w: RewardConfig) -> list[str]:
    """Range checks of the GenRM judge settings (also used by rewards.check_reward)."""
    e: list[str] = []
    positive(e, "reward.judge_max_new_tokens", w.judge_max_new_tokens)
    positive(e, "reward.judge_batch_size", w.judge_batch_size)
    if not w.judge_timeout_s > 0:
        e.append(f"reward.judge_timeout_s: must be > 0, got {w.judge_timeout_s}")
    if not w.judge_source:
        e.append("reward.judge_source: required for reward 'genrm'")
    return e


def _check_qwen(e: list[str], cfg: RunSections) -> None:
    """A Qwen multimodal policy: where it is loaded from, its video rate, and no warm start
    (the warm start feeds media to tiny-omni policies only)."""
    m = cfg.model
    if not m.source:
        e.append(
            f"model.source: required when model.kind is {m.kind!r}: a Hugging Face id (e.g. "
            "Qwen/Qwen3-VL-4B-Instruct), a model directory or its URL (s3://...)"
        )
    positive(e, "model.video_fps", m.video_fps)
    if cfg.warm_start.steps:
        e.append(
            f"warm_start.steps: the warm start feeds media to tiny-omni policies only; use 0 "
            f"with model.kind {m.kind!r}"
        )


def _check_env(e: list[str], cfg: RunSections) -> None:
    """Episode limits of a multi-turn run (the env itself is resolved at preflight)."""
    v, r = cfg.env, cfg.rollout
    if v.agent.strip():
        if v.name.strip():
            e.append(
                "env.agent: set together with env.name; an episode is played either by the loop "
                "against an env or by your agent through the endpoint, not both"
            )
        positive(e, "env.agent_workers", v.agent_workers)
        if v.tool_parser not in TOOL_PARSERS:  # the format the policy writes tool calls in
            e.append(f"env.tool_parser: unknown {v.tool_parser!r}; choose one of {TOOL_PARSERS}")
        if not v.agent_timeout_s > 0:
            e.append(f"env.agent_timeout_s: must be > 0, got {v.agent_timeout_s}")
        positive(e, "env.max_failed_agent_steps", v.max_failed_agent_steps, allow_zero=True)
        if cfg.model.kind not in ("tiny-qwen3", "pretrained"):
            e.append(
                f"env.agent: the endpoint serves text policies (model.kind 'tiny-qwen3' or "
                f"'pretrained'), not {cfg.model.kind!r}"
            )
    if not v.episodic:
        if v.kwargs:
            e.append("env.kwargs: set, but env.name is empty (a single-turn run has no env)")
        return
    if v.kwargs and not v.name.strip():
        e.append("env.kwargs: set, but env.name is empty (an agent takes no env kwargs)")
    positive(e, "env.max_turns", v.max_turns)
    if v.max_episode_tokens < r.max_new_tokens:
        e.append(
            f"env.max_episode_tokens: {v.max_episode_tokens} is below rollout.max_new_tokens "
            f"({r.max_new_tokens}), the budget of a single turn"
        )
    if cfg.model.kind in ("tiny-qwen3", "tiny-omni") and v.max_episode_tokens >= TINY_POSITIONS:
        e.append(
            f"env.max_episode_tokens: {v.max_episode_tokens} leaves no room for the prompt in "
            f"the tiny model's {TINY_POSITIONS} positions"
        )


def _check_services(e: list[str], cfg: RunSections) -> None:
    s = cfg.services
    choice(e, "services.launch", s.launch, LAUNCHES)
    choice(e, "services.weight_sync", s.weight_sync, WEIGHT_SYNCS)
    choice(e, "services.sync_backend", s.sync_backend, SYNC_BACKENDS)
    positive(e, "services.rollout_workers", s.rollout_workers)
    positive(e, "services.rollout_batch_groups", s.rollout_batch_groups, allow_zero=True)
    positive(e, "services.bucket_mb", s.bucket_mb)
    positive(e, "services.rollout_threads", s.rollout_threads)
    positive(e, "services.trainer_gpus", s.trainer_gpus)
    positive(e, "services.rollout_gpus", s.rollout_gpus)
    positive(e, "services.trainer_threads", s.trainer_threads, allow_zero=True)
    for name in (
        "poll_s",
        "heartbeat_s",
        "start_timeout_s",
        "heartbeat_timeout_s",
        "restart_window_s",
    ):
        positive(e, f"services.{name}", getattr(s, name))
    positive(e, "services.max_role_restarts", s.max_role_restarts, allow_zero=True)
    positive(e, "services.max_global_restarts", s.max_global_restarts, allow_zero=True)
    if not 0 <= s.scale_api_port <= 65535:
        e.append(
            f"services.scale_api_port: a TCP port 0..65535 (0 = any free), got {s.scale_api_port}"
        )
    if not s.scale_api_host.strip():
        e.append("services.scale_api_host: empty; use 127.0.0.1 (loopback) or an address to expose")
    if s.max_rollout_workers < s.rollout_workers:
        e.append(
            f"services.max_rollout_workers: {s.max_rollout_workers} is below "
            f"services.rollout_workers ({s.rollout_workers}), the engines a run starts with"
        )
    positive(e, "services.stall_timeout_s", s.stall_timeout_s, allow_zero=True)
    # A role waiting out a storage outage is not hung; the outage ends it first, named.
    floor = max(s.heartbeat_s, cfg.storage.outage_limit_s)
    if s.stall_timeout_s > 0 and s.stall_timeout_s <= floor:
        e.append(
            f"services.stall_timeout_s: must exceed services.heartbeat_s ({s.heartbeat_s}) and "
            f"storage.outage_limit_s ({cfg.storage.outage_limit_s}), got {s.stall_timeout_s} "
            "(0 turns the stall watch off)"
        )
    if s.heartbeat_timeout_s <= 2 * s.heartbeat_s:
        e.append(
            f"services.heartbeat_timeout_s: must exceed twice services.heartbeat_s "
            f"({s.heartbeat_s}), got {s.heartbeat_timeout_s}; a late beat is not silence"
        )


def _check_routing_replay(e: list[str], cfg: RunSections) -> None:
    """R3 replays an MoE policy's routers (models/routing_replay.py) on single-turn rows. A
    pretrained policy is checked when it loads (attaching to a dense one names its class)."""
    m = cfg.model
    if m.kind == "tiny-qwen3" and m.num_experts == 0:
        e.append(
            "train.routing_replay: the policy is dense (model.num_experts is 0), so there are no "
            "routers to replay; set model.num_experts > 0 or routing_replay: false"
        )
    elif m.kind not in ("tiny-qwen3", "pretrained"):
        e.append(
            f"train.routing_replay: needs a text MoE policy (model.kind 'tiny-qwen3' with "
            f"model.num_experts > 0, or a pretrained MoE); model.kind {m.kind!r} is not one"
        )
    if cfg.env.episodic:
        e.append(
            "train.routing_replay: multi-turn rows (env.name or env.agent set) carry no routed experts for "
            "their observation tokens; use a single-turn run or routing_replay: false"
        )


def _check_matmul_dtype(e: list[str], cfg: RunSections) -> None:
    m = cfg.model
    choice(e, "model.matmul_dtype", m.matmul_dtype, MATMUL_DTYPES)
    if m.dtype != "float32":
        e.append(
            f"model.matmul_dtype: bf16 matmuls on float32 weights; with model.dtype {m.dtype!r} "
            "every op runs in it already (use model.dtype float32)"
        )
    if m.kind not in ("tiny-qwen3", "pretrained"):
        e.append(
            f"model.matmul_dtype: needs a text policy (model.kind 'tiny-qwen3' or 'pretrained'), "
            f"not {m.kind!r}"
        )
    if cfg.rollout.engine != "torch" or cfg.train.backend != "torch" or cfg.train.lora.rank > 0:
        e.append(
            "model.matmul_dtype: needs rollout.engine torch, train.backend torch and no LoRA "
            "(engines that compute as the trainer does, on their own weights)"
        )


def validate(cfg: RunSections) -> list[str]:
    """Value checks that need no I/O; returns a list of problems (empty when fine)."""
    e: list[str] = []
    choice(e, "mode", cfg.mode, MODES)
    m = cfg.model
    choice(e, "model.kind", m.kind, MODEL_KINDS)
    choice(e, "model.dtype", m.dtype, DTYPES)
    if m.matmul_dtype:
        _check_matmul_dtype(e, cfg)
    if m.kind == "pretrained" and not m.source:
        e.append("model.source: required when model.kind is 'pretrained'")
    if m.kind in QWEN_MULTIMODAL:
        _check_qwen(e, cfg)
    e += source_form_problems(m.source)
    positive(e, "tracking.request_timeout_s", cfg.tracking.request_timeout_s)
    if not 0 <= cfg.tracking.request_retries <= 10:
        e.append(f"tracking.request_retries: must be 0-10, got {cfg.tracking.request_retries}")
    name = cfg.tracking.registered_model
    if name and not MODEL_NAME.fullmatch(name):
        e.append(
            f"tracking.registered_model: {name!r} must be letters, digits, '.', '_' or '-' "
            "(it becomes part of a models:/ URI)"
        )
    if m.kind == "tiny-omni":
        for name in ("image_size", "patch_size", "audio_rate", "n_mels", "audio_tokens"):
            positive(e, f"model.{name}", getattr(m, name))
        positive(e, "model.video_frames", m.video_frames)
        positive(e, "model.video_fps", m.video_fps)
        if m.patch_size > 0 and m.image_size % m.patch_size:
            e.append("model.image_size: must be divisible by model.patch_size")
        if m.audio_rate < 1000:
            e.append(
                f"model.audio_rate: {m.audio_rate} Hz is too low for log-mel features (>= 1000)"
            )
    d = cfg.data
    for name in ("max_media_bytes", "max_image_pixels", "max_audio_seconds", "max_video_seconds"):
        positive(e, f"data.{name}", getattr(d, name))
    positive(e, "data.max_video_frames", d.max_video_frames)
    if m.kind in ("tiny-qwen3", "tiny-omni"):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            positive(e, f"model.{name}", getattr(m, name))
        if m.num_heads > 0 and m.hidden_size % m.num_heads:
            e.append("model.hidden_size: must be divisible by model.num_heads")
        if m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads:
            e.append("model.num_heads: must be divisible by model.num_kv_heads")
        positive(e, "model.num_experts", m.num_experts, allow_zero=True)
        if m.num_experts > 0 and not 1 <= m.experts_per_token <= m.num_experts:
            e.append(
                f"model.experts_per_token: must be in [1, model.num_experts={m.num_experts}], "
                f"got {m.experts_per_token}"
            )
    if m.num_experts and m.kind != "tiny-qwen3":
        e.append(
            f"model.num_experts: the tiny MoE policy is built for model.kind 'tiny-qwen3', not "
            f"{m.kind!r} (a pretrained MoE brings its own experts); use 0"
        )
    positive(e, "warm_start.steps", cfg.warm_start.steps, allow_zero=True)
    positive(e, "warm_start.lr", cfg.warm_start.lr)
    positive(e, "warm_start.batch_size", cfg.warm_start.batch_size)
    target = cfg.warm_start.target_accuracy
    if not 0.0 <= target <= 1.0:
        e.append(f"warm_start.target_accuracy: must be in [0, 1], got {target}")
    if cfg.warm_start.target_per_length and cfg.warm_start.steps and not target:
        e.append(
            "warm_start.target_per_length: holds warm_start.target_accuracy on each response "
            "length, and that is 0 (the warm start trains every step); set a target or unset it"
        )
    choice(e, "data.template", cfg.data.template, TEMPLATES)
    positive(e, "data.eval_size", cfg.data.eval_size, allow_zero=True)
    r = cfg.rollout
    choice(e, "rollout.engine", r.engine, ENGINES)
    check_gpu_stacks(e, cfg)
    if r.engine == "vllm":
        from relax_core.config.checks_vllm import check_vllm

        check_vllm(e, cfg, m.kind if MODALITIES.get(m.kind) else None)
    if r.engine == "sglang":
        check_sglang_context(e, cfg)
    if r.engine == "sglang" and MODALITIES.get(m.kind):
        e.append(
            f"rollout.engine: 'sglang' sends text token ids; a {m.kind} policy's media "
            "is not sent to it (image_data/audio_data) in this build; use 'torch'"
        )
    if r.n_samples_per_prompt < 2:
        e.append("rollout.n_samples_per_prompt: must be >= 2 (GRPO compares responses in a group)")
    positive(e, "rollout.groups_per_step", r.groups_per_step)
    positive(e, "rollout.max_new_tokens", r.max_new_tokens)
    positive(e, "rollout.temperature", r.temperature)
    if not 0 < r.top_p <= 1:
        e.append(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    if cfg.mode == "colocate" and r.max_staleness != 0:
        e.append("rollout.max_staleness: colocate mode is strict on-policy and needs 0")
    timed = r.max_staleness != 0 or cfg.services.rollout_workers != 1
    if cfg.train.deterministic and cfg.mode == "async" and timed:
        e.append(
            "train.deterministic: an async run repeats only at rollout.max_staleness 0 with "
            "services.rollout_workers 1 (otherwise timing decides what each step trains); "
            "set both, or train.deterministic: false"
        )
    positive(e, "rollout.max_staleness", r.max_staleness, allow_zero=True)
    _check_services(e, cfg)
    _check_env(e, cfg)
    _check_storage(e, cfg)
    q = cfg.queue
    if not q.root:
        e.append("queue.root: required (a local directory or s3://bucket/prefix)")
    _check_endpoint(e, "queue", q.root, q.endpoint_url)
    if not q.lease_ttl_s > 0:
        e.append(f"queue.lease_ttl_s: must be > 0, got {q.lease_ttl_s}")
    positive(e, "queue.retry_attempts", q.retry_attempts)
    choice(e, "queue.retention", q.retention, RETENTIONS)
    positive(e, "queue.keep_versions", q.keep_versions, allow_zero=True)
    if not cfg.reward.name:
        e.append("reward.name: required (a registered reward or 'module:function')")
    a = cfg.algorithm
    check_algorithm(e, cfg)
    if cfg.reward.name == "genrm":
        e.extend(judge_problems(cfg.reward))
    for name in ("eps_clip", "eps_clip_high"):
        positive(e, f"algorithm.{name}", getattr(a, name))
    for name in ("kl_coef", "entropy_coef"):
        positive(e, f"algorithm.{name}", getattr(a, name), allow_zero=True)
    t = cfg.train
    positive(e, "train.total_steps", t.total_steps)
    positive(e, "train.lr", t.lr)
    positive(e, "train.encoder_lr_scale", t.encoder_lr_scale)
    positive(e, "train.weight_decay", t.weight_decay, allow_zero=True)
    positive(e, "train.warmup_steps", t.warmup_steps, allow_zero=True)
    positive(e, "train.grad_clip", t.grad_clip, allow_zero=True)
    positive(e, "train.micro_batch_tokens", t.micro_batch_tokens)
    positive(e, "train.minibatches_per_step", t.minibatches_per_step)
    if t.minibatches_per_step > cfg.rollout.groups_per_step:
        e.append(
            "train.minibatches_per_step: must be <= rollout.groups_per_step (groups are not split)"
        )
    positive(e, "train.checkpoint_every", t.checkpoint_every)
    positive(e, "train.keep_checkpoints", t.keep_checkpoints)
    positive(e, "train.steps_per_node", t.steps_per_node)
    positive(e, "train.eval_every", t.eval_every, allow_zero=True)
    positive(e, "train.torch_threads", t.torch_threads, allow_zero=True)
    if t.routing_replay:
        _check_routing_replay(e, cfg)
    _check_lora(e, cfg)
    if not cfg.run_name or "/" in cfg.run_name:
        e.append(f"run_name: must be a non-empty name without '/', got {cfg.run_name!r}")
    if not cfg.queue.root:
        e.append("queue.root: required")
    return e


def _check_lora(e: list[str], cfg) -> None:
    lo = cfg.train.lora
    positive(e, "train.lora.rank", lo.rank, allow_zero=True)
    if lo.rank <= 0:
        return
    positive(e, "train.lora.alpha", lo.alpha)
    if not 0 <= lo.dropout < 1:
        e.append(f"train.lora.dropout: must be in [0, 1), got {lo.dropout}")
    if not [m for m in lo.target_modules.split(",") if m.strip()]:
        e.append("train.lora.target_modules: name at least one module (comma-separated)")
    if cfg.train.backend == "megatron":
        e.append(
            "train.lora: LoRA trains with train.backend 'torch' or 'fsdp', not 'megatron' "
            "(Megatron adapters are not implemented in this build)"
        )
    if cfg.rollout.engine == "sglang":  # adapters loaded by name through SGLang's LoRA API
        check_sglang_lora(e, cfg)


def _check_storage(e: list[str], cfg) -> None:
    st = cfg.storage
    if not st.root:
        e.append("storage.root: required (a local directory or a URL such as s3://bucket/prefix)")
    _check_endpoint(e, "storage", st.root, st.endpoint_url)
    if st.outage_limit_s < 0:
        e.append(
            f"storage.outage_limit_s: must be >= 0 (0 = stop at once), got {st.outage_limit_s}"
        )
    if "://" in st.scratch_dir:
        e.append(f"storage.scratch_dir: a local directory, got the URL {st.scratch_dir!r}")


def _check_endpoint(e: list[str], section: str, root: str, endpoint: str) -> None:
    """An S3 endpoint is for an s3:// root and is an http(s) URL."""
    if endpoint and not root.startswith(("s3://", "s3a://")):
        e.append(f"{section}.endpoint_url: only used with an s3:// root, but root is {root!r}")
    if endpoint and not endpoint.startswith(("http://", "https://")):
        e.append(f"{section}.endpoint_url: must start with http:// or https://, got {endpoint!r}")
