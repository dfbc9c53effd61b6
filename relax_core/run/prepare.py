"""Preparing the starting policy: a tiny model + warm start, or a pretrained chat model.

A prepared policy is an ordinary HF model directory (safetensors + tokenizer), cached under a key
derived from everything that determines it (`PolicySpec`), so a rerun (or a Flyte cache miss)
reuses it. The warm start of an agentic run learns the env's demonstration episodes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

from relax_core.config import (
    DataConfig,
    EnvConfig,
    ModelConfig,
    RunConfig,
    WarmStartConfig,
    config_from_dict,
)
from relax_core.config.checks import QWEN_MULTIMODAL
from relax_core.config.checks_source import is_url_source
from relax_core.heap import freeze_heap
from relax_core.models.omni import (
    ENCODERS_VERSION,
    OMNI_FIELDS,
    TinyOmni,
    add_media_token,
    media_placeholders,
    omni_spec,
)
from relax_core.models.policy import PREPARED_MARKER, load_policy
from relax_core.multimodal.media import media_limits
from relax_core.run.sources import local_source
from relax_core.storage import (
    is_committed,
    is_local,
    join,
    local_copy,
    publish_dir,
    scratch_root,
    where,
)

MARKER = PREPARED_MARKER
MOE_FIELDS = ("num_experts", "experts_per_token")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PolicySpec:
    """Everything that determines the starting weights, and nothing else (the cache key)."""

    model: ModelConfig
    warm_start: WarmStartConfig
    data: DataConfig
    seed: int
    data_fingerprint: str = ""
    registry_uri: str = ""
    """The MLflow tracking URI a `models:/<name>/<version>` source is read from."""
    env: EnvConfig = field(default_factory=EnvConfig)
    """An agentic run's env: the warm start learns its demonstration episodes."""
    source_key: str = ""
    """The content key of a URL model.source (run/sources.py): its files' listing."""

    @classmethod
    def of(
        cls,
        cfg: RunConfig,
        data_fingerprint: str = "",
        registry_uri: str = "",
        source_key: str = "",
    ) -> PolicySpec:
        """The spec of `cfg`'s starting policy; `model.matmul_dtype: auto` decided here, so the
        cache key and the warm start name what it computes in."""
        from relax_core.models.precision import resolve_matmul_dtype

        model = cfg.model
        matmuls = resolve_matmul_dtype(model.matmul_dtype)
        if matmuls != model.matmul_dtype:
            model = dataclasses.replace(model, matmul_dtype=matmuls)
        return cls(
            model,
            cfg.warm_start,
            cfg.data,
            cfg.seed,
            data_fingerprint,
            registry_uri,
            cfg.env,
            source_key,
        )

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): equal specs give equal text, so it can key a cache."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PolicySpec:
        data = json.loads(text)
        sections = config_from_dict(
            {
                "model": data["model"],
                "warm_start": data["warm_start"],
                "data": data["data"],
                "env": data.get("env") or {},
            }
        )
        return cls(
            sections.model,
            sections.warm_start,
            sections.data,
            data["seed"],
            data["data_fingerprint"],
            data.get("registry_uri", ""),
            sections.env,
            data.get("source_key", ""),
        )

    def key(self) -> str:
        model = dataclasses.asdict(self.model)
        if self.model.kind != "tiny-omni":  # the encoder fields shape nothing else
            model = {k: v for k, v in model.items() if k not in OMNI_FIELDS}
        else:
            model["encoders_version"] = ENCODERS_VERSION
        if not self.model.num_experts:  # the MoE fields shape nothing of a dense policy
            model = {k: v for k, v in model.items() if k not in MOE_FIELDS}
        if not (self.model.matmul_dtype and self.warm_start.steps):
            # how the weights are used, not what they are; unless a warm start computes in it
            model.pop("matmul_dtype")
        if self.model.chat_template:  # keyed by content: an edited file is a new policy
            model["chat_template"] = file_digest(self.model.chat_template)
        else:  # absent when unset, so policies without one keep their keys
            model.pop("chat_template")
        parts: dict[str, object] = {
            "model": model,
            "warm_start": dataclasses.asdict(self.warm_start),
        }
        w = self.warm_start
        if not (w.target_accuracy and w.steps):
            # Absent when it shapes nothing, so older policies keep their keys.
            parts["warm_start"].pop("target_accuracy")  # type: ignore[attr-defined]
        if not (w.target_per_length and w.target_accuracy and w.steps):
            parts["warm_start"].pop("target_per_length")  # type: ignore[attr-defined]
        if self.model.kind != "pretrained" or self.warm_start.steps > 0:
            # The seed draws a tiny policy's weights and a warm start's batches; a converted
            # pretrained policy is the same whatever it is (runs of several seeds share it).
            parts["seed"] = self.seed
        if self.registry_uri:
            parts["registry_uri"] = self.registry_uri
        if self.source_key:  # absent for other sources, so their policies keep their keys
            parts["source_key"] = self.source_key
        if self.warm_start.steps > 0:
            d = self.data
            parts["data"] = [d.train_path, d.template, d.system_prompt, self.data_fingerprint]
            if self.env.name:  # absent otherwise, so single-turn policies keep their keys
                parts["env"] = dataclasses.asdict(self.env)
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
        name = {"tiny-qwen3": "tiny", "tiny-omni": "omni"}.get(self.model.kind, "pretrained")
        return f"{name}-{digest}"


def prepare_policy(
    spec: PolicySpec, cache_dir: str, options: dict | None = None, scratch_dir: str = ""
) -> str:
    """Where the starting policy for `spec` is (under `cache_dir`, a directory or a URL), built
    once and then reused: a published directory whose PREPARED.json marker comes last."""
    target = join(cache_dir, spec.key())
    if is_committed(target, MARKER, options):
        return where(target)
    # Downloads and conversions (GGUF, registry) stay on this task's disk.
    local_cache = cache_dir if is_local(cache_dir) else scratch_root(scratch_dir)
    model, tokenizer = _base_model(spec, local_cache, options, scratch_dir)
    if spec.model.chat_template:
        tokenizer.chat_template = read_chat_template(spec.model.chat_template)
    info: dict[str, object] = {"key": spec.key()}
    freeze_heap()  # imports and the model are in place: the warm start's steps come next
    if spec.warm_start.steps > 0:
        info.update(_run_warm_start(spec, model, tokenizer))

    def build(staging: str) -> dict[str, object]:
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        return info

    return publish_dir(target, MARKER, build, options, scratch_dir)


def local_policy(policy_dir: str, options: dict | None = None, scratch_dir: str = "") -> str:
    """A local directory holding the prepared policy at `policy_dir` (copied once if remote)."""
    return local_copy(policy_dir, MARKER, options, scratch_dir)


def read_chat_template(path: str) -> str:
    """The Jinja text of a model.chat_template file; ValueError naming it when unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"model.chat_template: cannot read {path!r}: {exc}") from exc
    if "{%" not in text and "{{" not in text:
        raise ValueError(f"model.chat_template: {path!r} holds no Jinja template")
    return text


def file_digest(path: str) -> str:
    return hashlib.sha256(read_chat_template(path).encode()).hexdigest()[:16]


def _base_model(spec: PolicySpec, cache_dir: str, options: dict | None, scratch_dir: str):
    source = spec.model.source
    if is_url_source(source):  # copied to this task's scratch once per content
        source = local_source(source, spec.source_key, options, scratch_dir)
    if spec.model.kind in ("tiny-qwen3", "tiny-omni"):
        from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3

        tokenizer = build_char_tokenizer()
        if spec.model.kind == "tiny-omni":
            media_token_id = add_media_token(tokenizer)
            lm = build_tiny_qwen3(spec.model, len(tokenizer), spec.seed)
            return TinyOmni(lm, omni_spec(spec.model), media_token_id), tokenizer
        return build_tiny_qwen3(spec.model, len(tokenizer), spec.seed), tokenizer
    if spec.model.kind in QWEN_MULTIMODAL:
        # A Hugging Face id (downloaded to the HF cache) or a directory, as transformers reads it.
        from relax_core.multimodal.qwen import load_qwen_policy

        return load_qwen_policy(source, spec.model.dtype, spec.model.video_fps)
    if source.startswith("models:"):
        # A registered policy of an earlier run: its HF directory, pinned to one version upstream.
        from relax_core.tracking.registry import download_policy

        directory = download_policy(spec.registry_uri, source, os.path.join(cache_dir, "registry"))
        return load_policy(directory, spec.model.dtype)
    from relax_core.models.pretrained import materialize

    directory = materialize(source, os.path.join(cache_dir, "hf"))
    return load_policy(directory, spec.model.dtype)


def _run_warm_start(cfg: PolicySpec, model, tokenizer) -> dict[str, object]:
    """Runs the warm start on `model`; what PREPARED.json records of it."""
    import torch

    from relax_core.data.dataset import load_prompts
    from relax_core.data.templates import render_prompt
    from relax_core.models.precision import resolve_matmul_dtype
    from relax_core.train.warm_start import answer_examples, warm_start

    rows = load_prompts(cfg.data.train_path)
    system = cfg.data.system_prompt or None
    media = None
    if isinstance(model, TinyOmni):
        from relax_core.multimodal.inputs import MediaResolver, split_by_media

        usable, _ = split_by_media(rows, MediaResolver(model.spec, media_limits(cfg.data)))
        rows = [row for row, _ in usable]
        media = [inputs for _, inputs in usable]
    texts = [render_prompt(row["prompt"], cfg.data.template, tokenizer, system) for row in rows]
    # One tokenizer call for the whole dataset: the same ids as one call per prompt.
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    prompt_ids = [list(ids) for ids in encoded]
    if isinstance(model, TinyOmni):
        prompt_ids = [
            media_placeholders(row, model.spec, model.media_token_id) + ids
            for row, ids in zip(rows, prompt_ids, strict=True)
        ]
    w = cfg.warm_start
    if cfg.env.name:
        examples, media = demonstration_examples(cfg, model, tokenizer, rows, prompt_ids, media)
    elif cfg.env.agent:
        from relax_core.roles.agent_demos import agent_demonstration_examples

        examples = agent_demonstration_examples(cfg.env, tokenizer, rows, w.steps * w.batch_size)
    else:
        examples = answer_examples(tokenizer, prompt_ids, [row["answer"] for row in rows])
    matmuls = resolve_matmul_dtype(cfg.model.matmul_dtype)
    result = warm_start(
        model,
        tokenizer,
        examples,
        w.steps,
        w.lr,
        w.batch_size,
        cfg.seed,
        media=media,
        target_accuracy=w.target_accuracy,
        target_per_length=w.target_per_length,
        matmul_dtype=getattr(torch, matmuls) if matmuls else None,
    )
    losses = result.losses
    info: dict[str, object] = {
        "warm_start_loss": [round(x, 4) for x in losses[:: max(1, len(losses) // 20)]],
        "warm_start_steps": result.steps,
    }
    if result.probe_accuracy is not None:
        info["warm_start_probe_accuracy"] = round(result.probe_accuracy, 4)
        if result.probe_accuracy < w.target_accuracy:
            log.warning(
                "warm start: the probe's accuracy is %.3f after warm_start.steps=%d, short of "
                "warm_start.target_accuracy=%.3f; RL starts from there",
                result.probe_accuracy,
                result.steps,
                w.target_accuracy,
            )
    return info


def demonstration_examples(cfg: PolicySpec, model, tokenizer, rows, prompt_ids, media):
    """Warm-start examples of an agentic run: each row's demonstration played against the env
    (rollout/demonstrations.py), kept only when the env accepts it as a correct, complete
    episode. Returns the examples and the media of the rows kept (None for text)."""
    from relax_core.envs import DEMONSTRATIONS, resolve_env
    from relax_core.rollout.demonstrations import demonstration_episode
    from relax_core.rollout.multiturn import EpisodeLimits
    from relax_core.rollout.observations import ObservationRenderer

    v = cfg.env
    if v.name not in DEMONSTRATIONS:
        raise ValueError(
            f"warm_start.steps: env {v.name!r} ships no demonstrations; the warm start of a "
            f"multi-turn run needs one of {', '.join(sorted(DEMONSTRATIONS))} (or steps: 0)"
        )
    factory = resolve_env(v.name, **v.kwargs)
    limits = EpisodeLimits(v.max_turns, v.max_episode_tokens)
    observed = None
    if isinstance(model, TinyOmni):
        from relax_core.multimodal.inputs import MediaResolver
        from relax_core.multimodal.placeholders import OmniPlaceholders

        resolver = MediaResolver(model.spec, media_limits(cfg.data))
        observed = OmniPlaceholders(resolver, model.spec, model.media_token_id)
    render = ObservationRenderer(tokenizer, cfg.data.template, observed)
    examples, kept_media = [], []
    for i, (row, ids) in enumerate(zip(rows, prompt_ids, strict=True)):
        turns = DEMONSTRATIONS[v.name](row)
        ep = demonstration_episode(tokenizer, factory, row, ids, turns, limits, render)
        if ep.correct and ep.end_reason == "done":
            examples.append((ids, ep.response_ids, ep.loss_mask))
            if media is not None:
                kept_media.append(media[i])
    if not examples:
        raise ValueError(
            f"warm_start.steps: no demonstration of env {v.name!r} fits env.max_turns "
            f"{v.max_turns} and env.max_episode_tokens {v.max_episode_tokens}"
        )
    return examples, (kept_media if media is not None else None)
