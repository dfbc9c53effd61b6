"""The memory plan as `relax plan`, the supervisor and the Flyte tasks print it."""

from __future__ import annotations

from relax_core.config import RunConfig
from relax_core.plan.devices import GIB, Gpu
from relax_core.plan.memory import MemoryPlan, MemoryPlanError, memory_plan


def _gib(n: int) -> str:
    return f"{n / GIB:7.1f}"


def render(plan: MemoryPlan) -> str:
    """Per-GPU memory by part, each process's total against the card, then the problems."""
    if plan.gpu is None:
        return (
            "memory plan: CPU: not planned (no GPU in the config: services.accelerator is empty; "
            "`relax plan --gpu h100` plans it for a card)"
        )
    gpu = plan.gpu
    lines = [f"memory plan per GPU ({gpu.name}, {gpu.gib:.1f} GiB; {plan.model}):"]
    for group in plan.groups:
        verdict = "fits" if group.total <= gpu.memory else "DOES NOT FIT"
        head = f"  {group.process} ({group.gpus}):"
        lines.append(f"{head:<66}{'GiB':>7}")
        lines.extend(f"    {part.name:<62}{_gib(part.bytes)}" for part in group.parts)
        share = 100 * group.total / gpu.memory
        lines.append(
            f"    {'total (' + f'{share:.0f}% of the card, {verdict})':<62}{_gib(group.total)}"
        )
    if plan.problems:
        lines.append("does not fit:")
        lines.extend(f"  - {problem}" for problem in plan.problems)
    else:
        lines.append("fits: every GPU's parts are within its memory")
    return "\n".join(lines)


def check_memory(cfg: RunConfig, gpu: Gpu | None) -> MemoryPlan:
    """The plan, or MemoryPlanError (whose message prints it) when it refuses the run."""
    plan = memory_plan(cfg, gpu)
    if not plan.fits:
        raise MemoryPlanError(render(plan))
    return plan
