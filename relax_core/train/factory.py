"""The trainer's TrainBackend for a run config (`train.backend`).

- torch: one process, the HF model and AdamW (the CPU default; one GPU).
- fsdp: the same model sharded with FSDP2 (train/fsdp.py) over the trainer's process group.
- megatron: Megatron-core (train/megatron/), converted from the HF policy, TP/EP per
  `train.parallel`.

Mixed precision: the torch and fsdp backends hold the policy in float32 master weights (and so
float32 gradients and AdamW state) whatever `model.dtype` is, and compute in `model.dtype`
(autocast for torch, FSDP2's MixedPrecisionPolicy for fsdp). An AdamW step at an RL learning rate
(~1e-6) is far below half a bfloat16 ulp of most weights: applied to bf16 parameters it rounds
away. The engines receive `model.dtype` (the backend casts what it publishes); checkpoints hold
the policy in `model.dtype` plus the float32 master weights beside the optimizer state (trainer
only). Megatron keeps float32 main parameters in its own mixed-precision optimizer.
`model.matmul_dtype` (torch backend, float32 `model.dtype`): autocast to it with float32
attention, and the engines receive float32 (models/precision.py gives them the same numerics).

fsdp and megatron run with the trainer's ranks in one process group: a trainer of one GPU forms
it alone; over `services.trainer_gpus` > 1 GPUs the trainer runs under torchrun, one process per
GPU (train/ranks.py: rank 0 leads, the others follow).
"""

from __future__ import annotations

import os

import torch

from relax_core.config import RunConfig
from relax_core.plan.devices import Gpu
from relax_core.plan.memory import trainer_checkpointing, trainer_offload
from relax_core.train.backend import MASTER_WEIGHTS_FILE


def trainer_policy(cfg: RunConfig, checkpoint: str):
    """(model, tokenizer) a trainer process holds beside its backend: the policy in
    `trainer_dtype`, or for Megatron, which reads its own shards from `checkpoint`, the HF
    architecture on the meta device (names and shapes for the weight-sync layout, no weights
    in host memory)."""
    from relax_core.models.lora import for_run
    from relax_core.models.policy import load_policy, load_tokenizer

    if cfg.train.backend != "megatron":
        model, tokenizer = load_policy(checkpoint, trainer_dtype(cfg))
        return for_run(model, cfg.train.lora, cfg.seed), tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(checkpoint)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, cfg.model.dtype))
    return model, load_tokenizer(checkpoint)


MASTER_DTYPE = "float32"
"""The dtype the torch and fsdp backends keep the policy's parameters in."""


def trainer_dtype(cfg: RunConfig, backend: str | None = None) -> str:
    """The dtype to load the policy in for `make_backend` (float32 master weights for torch and
    fsdp; Megatron converts from `model.dtype` and keeps its own float32 main parameters; a
    LoRA run trains float32 adapters on a frozen base in `model.dtype`)."""
    if (backend or cfg.train.backend) == "megatron" or cfg.train.lora.rank > 0:
        return cfg.model.dtype  # LoRA: the base is frozen, the adapters are float32 already
    return MASTER_DTYPE


def make_backend(
    model,
    cfg: RunConfig,
    backend: str | None = None,
    source: str | None = None,
    trains: bool = True,
):
    """`backend` overrides train.backend ('torch' for a process that only evaluates and writes
    a run's first checkpoint). `model` is loaded in `trainer_dtype(cfg, backend)`; Megatron
    reads each rank's shards from the policy directory `source` when given (`model` may then
    be a meta-device skeleton, see `trainer_policy`). Without `trains` (a process that never
    steps the optimizer) the torch backend keeps the policy in host memory, off the GPU its
    engines use."""
    t = cfg.train
    compute = getattr(torch, cfg.model.dtype)
    # Without an entropy term the entropy is a metric: no graph is kept behind it.
    entropy_grad = cfg.algorithm.entropy_coef > 0
    recompute = activation_checkpointing(cfg)
    if (backend or t.backend) == "torch":
        return _torch_backend(model, cfg, entropy_grad, recompute, trains)
    device = _trainer_group(cfg.services.trainer_gpus)
    if t.backend == "fsdp":
        from relax_core.train.fsdp import build_fsdp_backend

        return build_fsdp_backend(
            model.to(device),
            t,
            cfg.rollout.temperature,
            device=device,
            compute_dtype=compute,
            entropy_grad=entropy_grad,
            activation_checkpointing=recompute,
        )
    from relax_core.train.megatron.backend import build_megatron_backend
    from relax_core.train.megatron.config import MegatronParallel

    p = t.parallel
    parallel = MegatronParallel(
        tp=p.tensor,
        pp=p.pipeline,
        cp=p.context,
        ep=p.expert,
        sequence_parallel=p.sequence_parallel and p.tensor > 1,
        distributed_optimizer=p.distributed_optimizer,
        recompute=recompute,
    )
    return build_megatron_backend(
        source or model,
        t,
        cfg.rollout.temperature,
        parallel,
        cfg.model.dtype,
        routing_replay=t.routing_replay,
        moe_aux_loss_coeff=t.moe_aux_loss_coef,
    )


def _torch_backend(model, cfg: RunConfig, entropy_grad: bool, recompute: bool, trains: bool):
    """The torch backend on this process's GPU (or CPU), computing in model.dtype, or in
    model.matmul_dtype's bf16 linear layers with float32 attention. A trainer that gives its
    GPU back between steps (train.offload_between_steps) starts with its trainable state in
    host memory: the first step's reload is its first trip to the GPU."""
    from relax_core.models.attention import use_float32_attention
    from relax_core.models.policy import accelerator
    from relax_core.models.precision import resolve_matmul_dtype
    from relax_core.train.torch_backend import build_backend

    device = accelerator() if trains else None  # log-probs come back to the CPU rows
    offload = trains and trainer_offload(cfg, on_gpu=device is not None)
    if device is not None and not offload:
        model.to(device)
    compute = getattr(torch, cfg.model.dtype)
    weights = None
    if cfg.model.matmul_dtype:  # bf16 matmuls, or auto's float32: float32 attention, packed
        use_float32_attention(model)
    if matmul_name := resolve_matmul_dtype(cfg.model.matmul_dtype):  # bf16 linear layers
        compute, weights = getattr(torch, matmul_name), compute
    built = build_backend(
        model,
        cfg.train,
        cfg.rollout.temperature,
        compute_dtype=compute,
        weights_dtype=weights,
        entropy_grad=entropy_grad,
        activation_checkpointing=recompute,
        device=device,
    )
    if offload:  # trainable state to the host store, then the rest (a frozen base, buffers)
        built.offload()
        if device is not None:
            model.to(device)
    return built


def activation_checkpointing(cfg: RunConfig) -> bool:
    """train.activation_checkpointing for this process: 'auto' asks the memory plan about the
    GPU this trainer runs on (off on a CPU)."""
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        gpu = Gpu(props.name, props.total_memory)
    return trainer_checkpointing(cfg, gpu)


TRAINING_STATE = {"torch": "optimizer.pt", "fsdp": "optim", "megatron": "megatron"}
"""Where each backend keeps its optimizer state in a checkpoint (beside the HF policy)."""

TRAINER_ONLY = (*TRAINING_STATE.values(), MASTER_WEIGHTS_FILE)
"""What only a trainer reads back from a checkpoint: optimizer state and master weights."""


def has_training_state(checkpoint: str, backend: str) -> bool:
    """Whether `checkpoint` holds optimizer state `backend` can load (a run's first checkpoint,
    written by the controller, holds the torch backend's fresh state only)."""
    return os.path.exists(os.path.join(checkpoint, TRAINING_STATE[backend]))


def _trainer_group(gpus: int) -> torch.device:
    """This process's place in the trainer's process group (nccl on GPUs, gloo otherwise): the
    one torchrun set up for `gpus` ranks, or a group of this process alone."""
    import torch.distributed as dist

    from relax_core.net import free_port

    cuda = torch.cuda.is_available()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != gpus:
        raise RuntimeError(
            f"services.trainer_gpus is {gpus} but this trainer has {world} rank(s): a trainer "
            f"over several GPUs runs under torchrun --nproc-per-node {gpus} (the supervisor and "
            "the Flyte trainer task start it so)"
        )
    if not dist.is_initialized():
        if world == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
            dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
        else:
            dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's env://
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")
