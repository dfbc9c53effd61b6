"""`relax plan --cfg C [--gpu h100|h200|...] [--flyte [--limits L]] [--set a.b=v ...]`: where each
process of a run goes and what each GPU holds, part by part, and with --flyte what a Flyte
cluster would refuse, clamp or kill (relax_core/ops/flyte_plan.py), on any machine (no GPU, no
cluster needed). Exits 1 when the run would not fit or Flyte would stop it (each problem named
with the setting to change), 2 when the config, the card or the limits are wrong."""

from __future__ import annotations

import argparse
import sys

import yaml

from relax_core.config import ConfigError, RunConfig, config_from_dict, config_to_dict, load_config
from relax_core.ops.flyte_plan import PRESETS, flyte_plan, parse_limits, render_flyte
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
    parser.add_argument(
        "--flyte",
        action="store_true",
        help="also check the run against a Flyte cluster: task resources against its limits, "
        "timeouts, images, the loop's depth, storage and tracking reachable from pods",
    )
    parser.add_argument(
        "--limits",
        default="stock",
        help=f"the cluster's task resource limits for --flyte: {' or '.join(PRESETS)} "
        "(docs/cluster.md's values), or cpu=N,memory=NGi,gpu=N[,max_parallelism=N] "
        "(default: stock)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="change one setting of the config for this plan (YAML value), e.g. "
        "--set storage.root=s3://bucket/relax; repeatable",
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


def load_with_settings(path: str, settings: list[str]) -> RunConfig:
    """The config file at `path` with each `section.field=value` (a YAML value) set, as if the
    file said so (places derived from storage.root follow a new root); checked as a file is."""
    cfg = load_config(path)
    if not settings:
        return cfg
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    for item in settings:
        path, sep, text = item.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ValueError(f"--set {item!r}: expected SECTION.FIELD=VALUE")
        node, sections = data, config_to_dict(cfg)
        for key in keys[:-1]:
            if not isinstance(sections.get(key), dict):
                raise ConfigError(f"--set {item!r}: {key!r} is not a section of the config")
            node, sections = node.setdefault(key, {}), sections[key]
        node[keys[-1]] = yaml.safe_load(text) if text.strip() else ""
    return config_from_dict(data)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = load_with_settings(args.cfg, args.set)
        gpu = plan_gpu(cfg, args.gpu or None)
        limits = parse_limits(args.limits)
    except (ConfigError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    memory = memory_plan(cfg, gpu)
    print(f"{args.cfg} ({cfg.mode}, rollout {cfg.rollout.engine}, train {cfg.train.backend})")
    print(placement_text(cfg, gpu is not None))
    print(render(memory))
    fits = memory.fits
    if args.flyte:
        flyte = flyte_plan(cfg, limits)
        print(render_flyte(flyte))
        fits = fits and flyte.fits
    return 0 if fits else 1
