"""Which GPUs each process of a run uses: a pure function of the config and the devices visible.

The supervisor prints the plan at start, writes it to the run directory (`placement.json`) and
applies it through each process's environment (`CUDA_VISIBLE_DEVICES`), so trainer ranks,
engines and SGLang servers never land on one GPU by accident: a process sees only its own
devices, torchrun's local ranks and an SGLang server's tensor-parallel group (`--tp-size`,
base GPU 0) count from the first of them.

- async: the trainer takes `services.trainer_gpus` devices, then each rollout worker the GPUs of
  its engine (an SGLang server: `rollout_gpus` x its `--dp-size`; a torch engine:
  `rollout_gpus`), then the reference and actor_fwd roles one each when the run has them. The
  advantages role is CPU only.
- colocate: one process holds policy, trainer and engine; it sees as many devices as the larger
  of the trainer and its SGLang server needs (the server gives its memory back while the trainer
  works, so they share by design).
A plan that needs more GPUs than are visible is refused with the count of each part. With no GPU
visible (a CPU run) nothing is set. `preflight_gpus` adds the memory plan (relax_core/plan): what
each GPU holds, refused before anything starts when it does not fit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from relax_core.config import RunConfig
from relax_core.config.checks_gpu import data_parallel
from relax_core.plan.devices import Gpu
from relax_core.plan.memory import plan_gpu
from relax_core.plan.report import check_memory, render
from relax_core.roles.service import stage_chain

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


class PlacementError(ValueError):
    """The run's processes do not fit the visible GPUs."""


@dataclass(frozen=True)
class Slot:
    process: str
    """`trainer-0`, `rollout-<i>`, `reference-0`, `actor_fwd-0` or `colocate`."""
    devices: tuple[str, ...]
    """Device ids as the parent sees them (entries of its CUDA_VISIBLE_DEVICES, or indices)."""
    why: str
    """What the devices are for, for the printed plan."""


def sglang_gpus(cfg: RunConfig) -> int:
    """GPUs of one SGLang server: tensor parallel over rollout_gpus, times its replicas."""
    return cfg.services.rollout_gpus * data_parallel(cfg.sglang.extra_args)


def engine_gpus(cfg: RunConfig) -> int:
    """GPUs of one rollout worker's engine."""
    return sglang_gpus(cfg) if cfg.rollout.engine == "sglang" else cfg.services.rollout_gpus


def demand(cfg: RunConfig) -> list[tuple[str, int, str]]:
    """(process, GPUs, what for) of every process that holds a model, in placement order."""
    s = cfg.services
    if cfg.mode == "colocate":
        server = engine_gpus(cfg) if cfg.rollout.engine == "sglang" else 0
        what = f"trainer on the first {s.trainer_gpus}"
        if server:
            what += f", SGLang server (tp {s.rollout_gpus}) on all {server}, taking turns"
        return [("colocate", max(s.trainer_gpus, server), what)]
    if cfg.rollout.engine == "sglang":
        engine_what = f"SGLang server (tp {s.rollout_gpus})"
    elif cfg.rollout.engine == "vllm":
        engine_what = f"vLLM server (tp {s.rollout_gpus})"
    else:
        engine_what = "torch engine"
    out = [("trainer-0", s.trainer_gpus, f"{cfg.train.backend} trainer, one rank per GPU")]
    out += [(f"rollout-{i}", engine_gpus(cfg), engine_what) for i in range(s.rollout_workers)]
    for role, _, _ in stage_chain(cfg):
        if role != "advantages":
            out.append((f"{role}-0", 1, f"{role} model"))
    return out


def plan(cfg: RunConfig, visible: list[str]) -> list[Slot]:
    """Each model-holding process's devices out of `visible`; [] when none is visible."""
    if not visible:
        return []
    wanted = demand(cfg)
    need = sum(n for _, n, _ in wanted)
    if need > len(visible):
        parts = " + ".join(f"{name} {n}" for name, n, _ in wanted)
        raise PlacementError(
            f"placement: this run needs {need} GPUs ({parts}) but {len(visible)} are visible "
            f"({VISIBLE_ENV}={','.join(visible)}); lower services.rollout_workers, "
            "services.rollout_gpus or services.trainer_gpus, or give the run more GPUs"
        )
    slots, start = [], 0
    for name, n, why in wanted:
        slots.append(Slot(name, tuple(visible[start : start + n]), why))
        start += n
    return slots


def visible_devices() -> list[str]:
    """The GPUs this process may hand out: its CUDA_VISIBLE_DEVICES entries, else every device
    torch sees."""
    listed = os.environ.get(VISIBLE_ENV)
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


_MODEL_ROLES = ("trainer-", "rollout-", "reference-", "actor_fwd-")


def env_for(slots: list[Slot], process: str) -> dict[str, str]:
    """The environment entries that put `process` (`<role>-<worker>`) on its devices: {} on a
    CPU run; no GPU for a process that holds no model (advantages)."""
    if not slots:
        return {}
    for slot in slots:
        if slot.process == process:
            return {VISIBLE_ENV: ",".join(slot.devices)}
    if process.startswith(_MODEL_ROLES):  # a rollout worker added by scaling out
        raise PlacementError(
            f"placement: no GPU left for {process}; every visible GPU is placed ({describe(slots)})"
        )
    return {VISIBLE_ENV: ""}


def describe(slots: list[Slot]) -> str:
    """The plan as printed at start: one line per process."""
    if not slots:
        return "placement: no GPU visible; every process runs on CPU"
    rows = [f"  {s.process:<12} GPU {','.join(s.devices):<16} {s.why}" for s in slots]
    return "placement:\n" + "\n".join(rows)


def planned_gpu(cfg: RunConfig, slots: list[Slot]) -> Gpu | None:
    """The card a run's memory is planned for: its services.accelerator, else the first
    visible GPU; None for a CPU run (not planned)."""
    if cfg.services.accelerator or not slots:
        return plan_gpu(cfg)
    import torch

    if not torch.cuda.is_available():  # device ids listed, but no CUDA in this process
        return None
    props = torch.cuda.get_device_properties(0)
    return Gpu(props.name, props.total_memory)


def preflight_gpus(cfg: RunConfig, visible: list[str]) -> tuple[list[Slot], str]:
    """(placement, the placement and memory plan as printed at start); PlacementError or
    plan.MemoryPlanError (its message: the whole plan and each problem) refuses the run."""
    slots = plan(cfg, visible)
    memory = check_memory(cfg, planned_gpu(cfg, slots))
    return slots, describe(slots) + "\n" + render(memory)
