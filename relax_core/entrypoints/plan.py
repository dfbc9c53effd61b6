"""`relax plan --cfg C [--gpu h100|h200|...]`: where each process of a run goes and what each
GPU holds, part by part, on any machine (no GPU needed). Exits 1 when the run would not fit
(each problem named with the setting to change), 2 when the config or the card is wrong."""

from __future__ import annotations

import argparse
import sys

from relax_core.config import ConfigError, RunConfig, load_config
from relax_core.ops.placement import PlacementError, demand, describe, plan
from relax_core.plan.devices import CARDS
from relax_core.plan.memory import memory_plan, plan_gpu
from relax_core.plan.report import render


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cfg", required=True, help="run config (YAML or JSON)")
    cards = ", ".join(sorted(k.removeprefix("nvidia-") for k in CARDS))
    parser.add_argument(
        "--gpu",
        default="",
        help=f"plan for this card (default: services.accelerator; a CPU run is not planned): {cards}",
    )


def placement_text(cfg: RunConfig, planned: bool) -> str:
    """The placement on as many GPUs as the run asks for (none for a CPU run)."""
    if not planned:
        return describe([])
    wanted = demand(cfg)
    count = sum(n for _, n, _ in wanted)
    try:
        slots = plan(cfg, [str(i) for i in range(count)])
    except PlacementError as err:  # only a run that needs no GPU at all gets here
        return str(err)
    return (
        f"placement on {count} GPU{'s' if count != 1 else ''}:\n"
        + describe(slots).split("\n", 1)[1]
    )


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.cfg)
        gpu = plan_gpu(cfg, args.gpu or None)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    memory = memory_plan(cfg, gpu)
    print(f"{args.cfg} ({cfg.mode}, rollout {cfg.rollout.engine}, train {cfg.train.backend})")
    print(placement_text(cfg, gpu is not None))
    print(render(memory))
    return 0 if memory.fits else 1
