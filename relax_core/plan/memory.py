"""One run's memory plan: its processes on their GPUs (as ops/placement.py places them), each
GPU's parts summed, and a refusal that names the parts and the settings to change.

Processes: async runs have the trainer (every GPU of it alike), rollout workers (an SGLang or
vLLM server over `services.rollout_gpus`, tensor parallel; a torch engine on the first), and the
reference and actor_fwd roles on one GPU each. A colocate run is one process whose first GPU
holds the trainer and the engine together. With train.offload_between_steps the two take turns
there: while the engine generates the trainer's state waits in host memory (a LoRA run's frozen
base stays), and while the trainer trains a sleeping server keeps only its CUDA context (a torch
engine its weights), so GPU 0 gets one line per turn. Without it the trainer keeps its memory
(state and the allocator's cached blocks) while the engine generates: both count at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_core.config import RunConfig
from relax_core.config.checks_gpu import data_parallel
from relax_core.plan import engines as e
from relax_core.plan import parts as p
from relax_core.plan.devices import GIB, Gpu, card_of, gpu_named
from relax_core.plan.shapes import KNOWN, Shape, model_shape

PROMPT_TOKENS = 256
"""Prompt length a text run is planned with (the shipped GSM-style chat prompts are shorter)."""
MEDIA_PROMPT_TOKENS = 1024
"""Prompt length of a multimodal run (images and video frames take hundreds of tokens)."""


class MemoryPlanError(ValueError):
    """The run does not fit its GPUs' memory; the message is the plan and its problems."""


@dataclass(frozen=True)
class GpuGroup:
    process: str
    """Who holds these GPUs (`trainer-0`, `rollout-0..6`, `colocate`)."""
    gpus: str
    """Which of the process's GPUs the line describes ("each of 8", "GPU 0")."""
    parts: tuple[p.Part, ...]

    @property
    def total(self) -> int:
        return sum(part.bytes for part in self.parts)


@dataclass(frozen=True)
class MemoryPlan:
    gpu: Gpu | None
    """The card planned for; None for a CPU run (not planned)."""
    model: str
    """The policy, as the plan names it."""
    groups: tuple[GpuGroup, ...] = ()
    problems: tuple[str, ...] = ()
    checkpointing: bool = False
    """The trainer's activation checkpointing (train.activation_checkpointing resolved)."""

    @property
    def fits(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class Lengths:
    seq: int
    """Tokens of one sequence: prompt + response."""
    response: int
    tokens: int
    """Tokens of one training micro-batch (micro_batch_tokens, or one whole sequence)."""

    @property
    def response_tokens(self) -> int:
        return self.tokens * self.response // self.seq


def plan_gpu(cfg: RunConfig, gpu: str | None = None) -> Gpu | None:
    """The card to plan for: `gpu` when given, else the config's accelerator; None = CPU."""
    if gpu:
        return gpu_named(gpu)
    s = cfg.services
    return card_of(s.accelerator, s.gpu_memory_gib) if s.accelerator else None


def lengths(cfg: RunConfig) -> Lengths:
    media = cfg.model.kind not in ("tiny-qwen3", "pretrained")
    response = cfg.env.max_episode_tokens if cfg.env.episodic else cfg.rollout.max_new_tokens
    seq = (MEDIA_PROMPT_TOKENS if media else PROMPT_TOKENS) + response
    return Lengths(seq, response, max(cfg.train.micro_batch_tokens, seq))


def memory_plan(cfg: RunConfig, gpu: Gpu | None) -> MemoryPlan:
    """The run's memory on `gpu` cards (None: a CPU run, not planned)."""
    if gpu is None:
        return MemoryPlan(None, _model_name(cfg))
    shape = model_shape(cfg.model, cfg.storage.endpoint_url)
    if shape is None:
        known = ", ".join(KNOWN)
        problem = (
            f"model.source: the shape of {cfg.model.source!r} is unknown here (no config.json "
            f"readable there, not in relax_core/plan/shapes.py KNOWN: {known})"
        )
        return MemoryPlan(gpu, _model_name(cfg), problems=(problem,))
    n = lengths(cfg)
    ckpt = _checkpointing(cfg, shape, gpu, n)
    groups = _groups(cfg, shape, gpu, n, ckpt)
    problems = [_problem(cfg, g, gpu, shape, n) for g in groups if g.total > gpu.memory]
    problems += e.engine_problems(cfg, shape, gpu, n.seq)
    return MemoryPlan(gpu, _model_name(cfg, shape), tuple(groups), tuple(problems), ckpt)


def trainer_checkpointing(cfg: RunConfig, gpu: Gpu | None) -> bool:
    """train.activation_checkpointing resolved for a trainer on `gpu` (None: a CPU, where auto
    is off): auto is on where the micro-batch's activations would not fit without it."""
    setting = cfg.train.activation_checkpointing
    if setting != "auto":
        return setting == "on"
    shape = model_shape(cfg.model, cfg.storage.endpoint_url)
    if gpu is None or shape is None:
        return False
    return _checkpointing(cfg, shape, gpu, lengths(cfg))


def trainer_offload(cfg: RunConfig, on_gpu: bool) -> bool:
    """train.offload_between_steps resolved for a trainer on a GPU (`on_gpu`) or a CPU: auto is
    on for a colocate run of the torch backend on a GPU, whose engine shares the trainer's."""
    setting = cfg.train.offload_between_steps
    if setting != "auto":
        return setting == "on"
    return on_gpu and cfg.mode == "colocate" and cfg.train.backend == "torch"


def _model_name(cfg: RunConfig, shape: Shape | None = None) -> str:
    name = cfg.model.source or cfg.model.kind
    if shape is None:
        return name
    return (
        f"{name}: {shape.params / 1e9:.2f} B parameters, {shape.layers} layers, vocab {shape.vocab}"
    )


def _checkpointing(cfg: RunConfig, shape: Shape, gpu: Gpu, n: Lengths) -> bool:
    setting = cfg.train.activation_checkpointing
    if setting != "auto":
        return setting == "on"
    if cfg.train.backend == "megatron" and cfg.train.routing_replay:
        return False  # Megatron's recompute would route the replayed tokens twice (replay.py)
    if cfg.mode == "colocate":  # the trainer's GPU holds the engine too
        training = [g for g in _colocate_groups(cfg, shape, gpu, n, False) if _trains(g)]
        return max(g.total for g in training) > gpu.memory
    return _trainer_group(cfg, shape, n, False).total > gpu.memory


def layout(cfg: RunConfig) -> p.TrainerLayout:
    t = cfg.train
    return p.TrainerLayout(
        backend=t.backend,
        gpus=cfg.services.trainer_gpus,
        tensor=t.parallel.tensor,
        expert=t.parallel.expert,
        distributed_optimizer=t.parallel.distributed_optimizer,
        lora=t.lora.rank > 0,
        compute_bf16=cfg.model.dtype in ("bfloat16", "float16") or bool(cfg.model.matmul_dtype),
        weight_bytes=4 if cfg.model.dtype == "float32" else 2,
    )


def trainer_parts(cfg: RunConfig, shape: Shape, n: Lengths, ckpt: bool) -> list[p.Part]:
    """One trainer GPU's parts, CUDA context left out."""
    lay = layout(cfg)
    state = p.trainer_state(shape, lay)
    if cfg.model.dtype == "float32" and not cfg.model.matmul_dtype and lay.backend != "megatron":
        state = [part for part in state if not part.name.startswith("policy weights (bf16")]
    on = "on" if ckpt else "off"
    acts = p.activations(shape, lay, n.tokens, n.seq, ckpt)
    head = "all positions" if lay.backend == "megatron" else "response tokens"
    out = state + [
        p.Part(
            f"activations ({n.tokens:,} tokens, checkpointing {on})",
            acts,
            "train.micro_batch_tokens, train.activation_checkpointing",
        ),
        p.Part(
            f"logits ({head}, vocab {shape.vocab:,})",
            p.logits(shape, lay, n.tokens, n.response_tokens),
            "train.micro_batch_tokens",
        ),
    ]
    if cfg.mode == "async" and cfg.services.weight_sync == "broadcast":
        out.append(
            p.Part(
                "weight-sync buckets (2 in flight)",
                2 * cfg.services.bucket_mb << 20,
                "services.bucket_mb",
            )
        )
    return out


def _trainer_group(cfg: RunConfig, shape: Shape, n: Lengths, ckpt: bool) -> GpuGroup:
    gpus = cfg.services.trainer_gpus
    where = f"each of {gpus} GPUs" if gpus > 1 else "1 GPU"
    parts = trainer_parts(cfg, shape, n, ckpt) + [p.Part("CUDA context", p.CUDA_CONTEXT)]
    return GpuGroup("trainer-0", where, tuple(parts))


def _groups(cfg: RunConfig, shape: Shape, gpu: Gpu, n: Lengths, ckpt: bool) -> list[GpuGroup]:
    """Each process's GPUs, in placement order, GPUs that hold the same grouped in one line."""
    if cfg.mode == "colocate":
        return _colocate_groups(cfg, shape, gpu, n, ckpt)
    out = [_trainer_group(cfg, shape, n, ckpt)]
    workers = cfg.services.rollout_workers
    if workers:
        name = "rollout-0" if workers == 1 else f"rollout-0..{workers - 1}"
        engine_gpus = _engine_gpus(cfg)
        if cfg.rollout.engine == "torch":
            where = "1 GPU" if engine_gpus == 1 else f"the first of {engine_gpus} GPUs"
        else:
            where = "1 GPU" if engine_gpus == 1 else f"each of {engine_gpus} GPUs"
        out.append(GpuGroup(name, where, tuple(e.engine_parts(cfg, shape, gpu, n.seq))))
    roles = []
    if cfg.algorithm.kl_coef > 0 or cfg.algorithm.distill_coef > 0:
        roles.append("reference-0")
    if cfg.services.actor_fwd:
        roles.append("actor_fwd-0")
    forward = tuple(e.forward_parts(cfg, shape, n.tokens, n.response_tokens))
    out += [GpuGroup(role, "1 GPU", forward) for role in roles]
    return out


def _engine_gpus(cfg: RunConfig) -> int:
    if cfg.rollout.engine == "sglang":
        return cfg.services.rollout_gpus * data_parallel(cfg.sglang.extra_args)
    return cfg.services.rollout_gpus


def _colocate_groups(
    cfg: RunConfig, shape: Shape, gpu: Gpu, n: Lengths, ckpt: bool
) -> list[GpuGroup]:
    """GPU 0 holds the trainer and the engine; a trainer over several GPUs and an SGLang
    server's other replicas (or tensor-parallel ranks) fill the rest."""
    trainer = trainer_parts(cfg, shape, n, ckpt)
    engine = e.engine_parts(cfg, shape, gpu, n.seq)
    engine_only = [part for part in engine if part.name != "CUDA context"]
    if trainer_offload(cfg, on_gpu=True):
        out = _taking_turns(cfg, trainer, engine)
    else:
        out = [GpuGroup("colocate", "GPU 0", tuple(trainer + engine_only + _context()))]
    trainers = cfg.services.trainer_gpus
    servers = _engine_gpus(cfg) if cfg.rollout.engine == "sglang" else 1
    start = 1
    for end, parts in (
        (min(trainers, servers), trainer + engine_only),
        (trainers, trainer),
        (servers, engine_only),
    ):
        if end > start:
            where = f"GPU {start}" if end == start + 1 else f"GPUs {start}-{end - 1}, each"
            out.append(GpuGroup("colocate", where, tuple(parts + _context())))
            start = end
    return out


def _taking_turns(cfg: RunConfig, trainer: list[p.Part], engine: list[p.Part]) -> list[GpuGroup]:
    """GPU 0 in its two turns: the engine generating beside what the trainer keeps there, and
    the trainer training beside what the engine keeps asleep (module doc). A server's CUDA
    context is its own, beside the trainer's."""
    kept = [part for part in trainer if part.name.startswith("policy weights (frozen base")]
    held = [part for part in trainer if part.name.startswith(("master weights", "optimizer"))]
    host = sum(part.bytes for part in held)  # gradients are dropped, the rest is transient
    away = p.Part(
        f"trainer state in host memory ({host / GIB:.1f} GiB there)",
        0,
        "train.offload_between_steps",
    )
    own = p.Part("CUDA context (the trainer's)", p.CUDA_CONTEXT)
    server = {"sglang": "SGLang", "vllm": "vLLM"}.get(cfg.rollout.engine, "")
    if not server:  # a torch engine in the trainer's process: its KV cache is freed
        engine = [part for part in engine if part.name != "CUDA context"]
        asleep = [part for part in engine if part.name.startswith("engine weights")]
    elif cfg.rollout.engine == "sglang" and not cfg.sglang.release_memory:
        asleep = [part for part in engine if part.name != "CUDA context"]
    else:
        asleep = [p.Part(f"{server} server asleep (its CUDA context)", p.CUDA_CONTEXT)]
    return [
        GpuGroup("colocate", "GPU 0, engine generating", tuple(kept + [away] + engine + [own])),
        GpuGroup("colocate", "GPU 0, trainer training", tuple(trainer + asleep + [own])),
    ]


def _trains(group: GpuGroup) -> bool:
    return any(part.name.startswith("activations") for part in group.parts)


def _context() -> list[p.Part]:
    return [p.Part("CUDA context", p.CUDA_CONTEXT)]


def _problem(cfg: RunConfig, group: GpuGroup, gpu: Gpu, shape: Shape, n: Lengths) -> str:
    """Why `group` does not fit: its total, its largest parts with their settings, and for a
    trainer the micro-batch that would fit."""
    named = sorted((part for part in group.parts if part.setting), key=lambda x: -x.bytes)
    listed = "; ".join(f"{x.name} {x.bytes / GIB:.1f} GiB ({x.setting})" for x in named[:4])
    text = (
        f"{group.process} ({group.gpus}): {group.total / GIB:.1f} GiB > "
        f"{gpu.gib:.1f} GiB of the {gpu.name}: {listed}"
    )
    per_token = [x for x in group.parts if x.name.startswith(("activations", "logits"))]
    if per_token:
        fixed = group.total - sum(x.bytes for x in per_token)
        per = sum(x.bytes for x in per_token) / n.tokens
        room = (gpu.memory - fixed) / per
        if room >= n.seq:
            fit = 1 << (int(room).bit_length() - 1)
            text += f"; train.micro_batch_tokens {fit:,} would fit here"
        elif cfg.train.backend == "megatron" and cfg.train.routing_replay:
            text += (
                f"; not even one sequence ({n.seq:,} tokens) fits, and Megatron's recompute is "
                "off under train.routing_replay: more services.trainer_gpus (expert data "
                "parallel), fused attention (TransformerEngine), or routing_replay off"
            )
        elif any("checkpointing off" in x.name for x in per_token):
            text += (
                f"; not even one sequence ({n.seq:,} tokens) fits without activation "
                "checkpointing: set train.activation_checkpointing on (or auto)"
            )
        else:
            text += (
                f"; not even one sequence ({n.seq:,} tokens) fits beside the rest: shard the "
                "trainer's state (services.trainer_gpus, train.backend fsdp or megatron) or use "
                "a larger GPU"
            )
    return text
