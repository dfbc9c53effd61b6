"""Value checks of the GPU stacks' settings: the accelerator a cluster gives the run, the SGLang
rollout engine and the FSDP2 and Megatron-core training backends. Called by checks.validate; no
I/O (whether CUDA is there is the roles' concern, checked when they start)."""

from __future__ import annotations

import re
import shlex

from relax_core.config.sections import RunSections

BACKENDS = ("torch", "fsdp", "megatron")
ACCELERATORS = (
    "nvidia-a10g",
    "nvidia-a100-80gb",
    "nvidia-h100",
    "nvidia-h200",
    "nvidia-l4",
    "nvidia-l4-vws",
    "nvidia-l40s",
    "nvidia-rtx-pro-6000",
    "nvidia-tesla-a100",
    "nvidia-tesla-k80",
    "nvidia-tesla-m60",
    "nvidia-tesla-p100",
    "nvidia-tesla-p4",
    "nvidia-tesla-t4",
    "nvidia-tesla-v100",
)
"""The NVIDIA GPUs flytekit.extras.accelerators names (config/ imports no flytekit, so a test keeps
the two lists equal). services.accelerator may name others (another cloud's node label value,
e.g. GKE's 'nvidia-h100-80gb'): any Kubernetes label value that names an NVIDIA card."""
LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
"""A Kubernetes label value: propeller makes the accelerator a required node label."""
SECRET_NAME = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")
"""A Kubernetes object name (an RFC 1123 subdomain), as sglang.api_key_secret must be."""
PAUSE_MODES = ("retract", "in_place", "abort")
MEGATRON_KINDS = ("tiny-qwen3", "pretrained")
"""Policies the Megatron backend converts (the Qwen3 family, dense and MoE)."""


def check_gpu_stacks(e: list[str], cfg: RunSections) -> None:
    accelerator = cfg.services.accelerator
    if accelerator and not (LABEL_VALUE.fullmatch(accelerator) and "nvidia" in accelerator):
        e.append(
            f"services.accelerator: {accelerator!r} is not an NVIDIA accelerator name (a "
            "Kubernetes label value with 'nvidia' in it, the value your GPU nodes carry under "
            f"propeller's gpu-device-node-label), e.g. {', '.join(ACCELERATORS[:5])}; '' = a "
            "CPU-only run"
        )
    if cfg.services.gpu_memory_gib < 0:
        e.append(f"services.gpu_memory_gib: must be >= 0, got {cfg.services.gpu_memory_gib}")
    for name in ("step_budget_s", "pending_s", "startup_s"):
        value = getattr(cfg.cluster, name)
        if not value > 0:
            e.append(f"cluster.{name}: must be > 0 seconds, got {value}")
    if cfg.rollout.engine == "sglang":
        _check_sglang(e, cfg)
    _check_checkpointing(e, cfg)
    _check_offload(e, cfg)
    _check_backend(e, cfg)


CHECKPOINTING = ("auto", "on", "off")
"""train.activation_checkpointing: 'auto' asks the memory plan (relax_core/plan)."""


def _check_checkpointing(e: list[str], cfg: RunSections) -> None:
    t = cfg.train
    if t.activation_checkpointing not in CHECKPOINTING:
        e.append(
            f"train.activation_checkpointing: {t.activation_checkpointing!r} is not one of "
            f"{', '.join(CHECKPOINTING)}"
        )
    elif t.activation_checkpointing == "on" and t.backend == "megatron" and t.routing_replay:
        e.append(
            "train.activation_checkpointing: 'on' with train.backend 'megatron' and "
            "train.routing_replay: Megatron's recompute would route the replayed tokens twice; "
            "use 'auto' or 'off', or lower train.micro_batch_tokens"
        )


def _check_offload(e: list[str], cfg: RunSections) -> None:
    t = cfg.train
    if t.offload_between_steps not in CHECKPOINTING:
        e.append(
            f"train.offload_between_steps: {t.offload_between_steps!r} is not one of "
            f"{', '.join(CHECKPOINTING)}"
        )
    elif t.offload_between_steps == "on" and (cfg.mode != "colocate" or t.backend != "torch"):
        e.append(
            "train.offload_between_steps: 'on' needs mode colocate and train.backend torch "
            f"(this run: mode {cfg.mode}, backend {t.backend}); use 'auto' or 'off'"
        )


def data_parallel(extra_args: str) -> int:
    """The data-parallel replicas `--dp-size` (or `--data-parallel-size`) asks of a server."""
    args = shlex.split(extra_args)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--dp-size", "--data-parallel-size"):
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"sglang.extra_args: {name} needs a count >= 1, got {value!r}")
            return int(value)
    return 1


def _check_sglang(e: list[str], cfg: RunSections) -> None:
    g = cfg.sglang
    if g.pause_mode not in PAUSE_MODES:
        e.append(f"sglang.pause_mode: {g.pause_mode!r} is not one of {', '.join(PAUSE_MODES)}")
    if not 0 < g.mem_fraction_static <= 1:
        e.append(f"sglang.mem_fraction_static: must be in (0, 1], got {g.mem_fraction_static}")
    if g.start_timeout_s <= 0:
        e.append(f"sglang.start_timeout_s: must be > 0, got {g.start_timeout_s}")
    if g.url and not g.url.startswith(("http://", "https://")):
        e.append(f"sglang.url: must start with http:// or https://, got {g.url!r}")
    if not SECRET_NAME.fullmatch(g.api_key_secret):
        e.append(
            f"sglang.api_key_secret: {g.api_key_secret!r} is not a Kubernetes secret name "
            "(lower-case letters, digits, '-' and '.', at most 253)"
        )
    if cfg.mode == "colocate" and g.release_memory and not g.handoff_dir:
        e.append("sglang.handoff_dir: required in colocate mode (weights go through it)")
    try:
        replicas = data_parallel(g.extra_args)
    except ValueError as err:
        e.append(str(err))
        replicas = 1
    if cfg.mode == "async" and replicas > 1:
        e.append(
            f"sglang.extra_args: --dp-size {replicas} in async mode: SGLang 0.5.23 refuses "
            "weight updates from the trainer's group on a server with data-parallel replicas; "
            f"run {replicas} rollout workers (services.rollout_workers), one server each, instead"
        )
    if cfg.mode == "async" and cfg.services.weight_sync != "broadcast":
        e.append(
            f"services.weight_sync: {cfg.services.weight_sync!r} with rollout.engine 'sglang'; "
            "SGLang servers receive weights through their own weight group: use 'broadcast'"
        )


def _check_backend(e: list[str], cfg: RunSections) -> None:
    t, p, gpus = cfg.train, cfg.train.parallel, cfg.services.trainer_gpus
    if t.moe_aux_loss_coef < 0:
        e.append(f"train.moe_aux_loss_coef: must be >= 0, got {t.moe_aux_loss_coef}")
    if t.backend not in BACKENDS:
        e.append(f"train.backend: {t.backend!r} is not one of {', '.join(BACKENDS)}")
        return
    sizes = {
        "tensor": p.tensor,
        "pipeline": p.pipeline,
        "context": p.context,
        "expert": p.expert,
    }
    for name, size in sizes.items():
        if size < 1:
            e.append(f"train.parallel.{name}: must be >= 1, got {size}")
    if any(size < 1 for size in sizes.values()):
        return
    split = {name: size for name, size in sizes.items() if size > 1}
    if t.backend != "megatron" and split:
        name, size = next(iter(split.items()))
        e.append(
            f"train.parallel.{name}: {size} needs train.backend 'megatron' ('{t.backend}' "
            "splits no model: torch runs one process, fsdp shards data-parallel only)"
        )
        return
    if t.backend == "torch":
        if gpus > 1:
            e.append(
                f"services.trainer_gpus: {gpus} GPUs need train.backend 'fsdp' or 'megatron' "
                "(the torch backend trains on one)"
            )
        return
    if gpus > 1 and cfg.mode == "colocate":
        e.append(
            f"services.trainer_gpus: {gpus} needs mode 'async' (colocate trains in its "
            "controller's one process; the async trainer runs one process per GPU)"
        )
    if cfg.model.kind not in MEGATRON_KINDS and t.backend == "megatron":
        e.append(
            f"train.backend: 'megatron' converts Qwen3 policies (model.kind "
            f"{' or '.join(MEGATRON_KINDS)}), not {cfg.model.kind!r}; use 'fsdp' or 'torch'"
        )
    if t.backend == "megatron" and p.tensor > 1 and t.routing_replay:
        e.append(
            f"train.parallel.tensor: {p.tensor} with an MoE policy needs sequence parallel, "
            "which needs TransformerEngine (not in the trainer image); use "
            "train.parallel.tensor 1 and split the experts with train.parallel.expert"
        )
    if t.backend == "megatron":
        for name in ("pipeline", "context"):
            if sizes[name] > 1:
                e.append(
                    f"train.parallel.{name}: the Megatron backend runs {name} parallel 1 in "
                    f"this build (got {sizes[name]}); split with tensor and expert parallel"
                )
    model_split = p.tensor * p.pipeline * p.context
    if gpus % model_split:
        e.append(
            f"services.trainer_gpus: {gpus} is not a multiple of train.parallel tensor x "
            f"pipeline x context = {model_split}"
        )
    elif (gpus // p.pipeline) % p.expert:
        e.append(
            f"train.parallel.expert: {p.expert} must divide the GPUs of one pipeline stage "
            f"(services.trainer_gpus / train.parallel.pipeline = {gpus // p.pipeline})"
        )
