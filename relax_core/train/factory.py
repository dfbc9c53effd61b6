"""The trainer's TrainBackend for a run config (`train.backend`).

- torch: one process, the HF model and AdamW (the CPU default; one GPU).
- fsdp: the same model sharded with FSDP2 (train/fsdp.py) over the trainer's process group.
- megatron: Megatron-core (train/megatron/), converted from the HF policy, TP/EP per
  `train.parallel`.

fsdp and megatron run with the trainer's ranks in one process group: a trainer of one GPU forms
it alone; over `services.trainer_gpus` > 1 GPUs the trainer runs under torchrun, one process per
GPU (train/ranks.py: rank 0 leads, the others follow).
"""

from __future__ import annotations

import os

import torch

from relax_core.config import RunConfig


def make_backend(model, cfg: RunConfig, backend: str | None = None):
    """`backend` overrides train.backend ('torch' for a process that only evaluates and writes
    a run's first checkpoint)."""
    from relax_core.train.torch_backend import build_backend

    t = cfg.train
    if (backend or t.backend) == "torch":
        if torch.cuda.is_available():  # the trainer's GPU; log-probs come back to the CPU rows
            model.to("cuda")
        return build_backend(model, t, cfg.rollout.temperature)
    device = _trainer_group(cfg.services.trainer_gpus)
    if t.backend == "fsdp":
        from relax_core.train.fsdp import build_fsdp_backend

        mixed = "bf16" if cfg.model.dtype == "bfloat16" else "none"
        return build_fsdp_backend(
            model.to(device), t, cfg.rollout.temperature, device=device, mixed_precision=mixed
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
    )
    return build_megatron_backend(
        model,
        t,
        cfg.rollout.temperature,
        parallel,
        cfg.model.dtype,
        routing_replay=t.routing_replay,
    )


TRAINING_STATE = {"torch": "optimizer.pt", "fsdp": "optim", "megatron": "megatron"}
"""Where each backend keeps its optimizer state in a checkpoint (beside the HF policy)."""


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
