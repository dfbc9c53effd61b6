"""Flyte local overhead: the same CPU-default run through `pyflyte run` and without Flyte.

Per round, A then B (the order alternating between rounds): `pyflyte run workflows/train.py
train --cfg C` and `python -m <launcher> --cfg C` (`bench.common.LAUNCHER`: the same run without
Flyte). C is the config with every place a run writes (queue, checkpoints, MLflow store) in a
fresh work directory per run and the shared policy cache, where the starting policy is prepared
once before the first round, so neither side pays for the warm start. Every run is a fresh
process pinned to the same CPU set (`--cpus`) with the same thread budget (`--threads`: the
config's train.torch_threads and OMP/MKL), bench.common.run_pinned.

    python bench/flyte_overhead.py [--rounds 3] [--cfg configs/cpu-default.yaml] [--cpus 0,1]
        [--threads 2]

Prints each round's wall seconds and overhead share, their median (min-max), and last
`headline: flyte_overhead_pct = X` (median over rounds of (flyte - plain) / flyte, in percent).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import statistics
import tempfile
import time

from bench.common import (
    LAUNCHER,
    add_pin_args,
    cpu_set,
    median_range,
    prepared_policy,
    repo_data,
    run_pinned,
    work_sections,
    write_config,
)
from relax_core.config import load_config, replace


def _timed(cmd: list[str], cfg, cpus: list[int], threads: int) -> float:
    """Wall seconds of `cmd --cfg <cfg in a fresh work directory>`, pinned."""
    work = tempfile.mkdtemp(prefix="flyte-overhead-")
    os.makedirs(os.path.join(work, "tmp"))
    path = write_config(replace(cfg, **work_sections(work)), os.path.join(work, "run.json"))
    env = {**os.environ, "TMPDIR": os.path.join(work, "tmp")}
    t0 = time.perf_counter()
    out = run_pinned([*cmd, "--cfg", path], cpus, threads, cwd=work, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cfg", default=os.path.join(REPO, "configs", "cpu-default.yaml"))
    add_pin_args(parser)
    args = parser.parse_args()
    cpus = cpu_set(args.cpus)
    base = load_config(args.cfg)
    cfg = replace(
        base,
        **repo_data(base),
        **work_sections(tempfile.mkdtemp(prefix="flyte-overhead-prepare-")),
        train={"torch_threads": args.threads},
    )
    prepared_policy(cfg)  # once, untimed: both sides find it in the shared cache
    bin_dir = os.path.dirname(sys.executable)
    flyte = [os.path.join(bin_dir, "pyflyte"), "run", f"{REPO}/workflows/train.py", "train"]
    plain = [sys.executable, "-m", LAUNCHER]
    print(
        f"{args.cfg}: {cfg.train.total_steps} steps, CPUs {cpus}, {args.threads} threads, "
        f"{args.rounds} rounds",
        flush=True,
    )
    rows = []
    for i in range(args.rounds):
        order = [("flyte", flyte), ("plain", plain)]
        if i % 2:
            order.reverse()
        walls = {name: _timed(cmd, cfg, cpus, args.threads) for name, cmd in order}
        rows.append(walls)
        print(
            f"round {i}: pyflyte {walls['flyte']:.1f} s, plain {walls['plain']:.1f} s", flush=True
        )
    print(f"| round | pyflyte run (s) | python -m {LAUNCHER} (s) | overhead |")
    print("| --- | --- | --- | --- |")
    shares = []
    for i, w in enumerate(rows):
        share = 100 * (w["flyte"] - w["plain"]) / w["flyte"]
        shares.append(share)
        print(f"| {i} | {w['flyte']:.1f} | {w['plain']:.1f} | {share:.1f}% |")
    print(
        f"pyflyte run {median_range([w['flyte'] for w in rows], 1)} s, without Flyte "
        f"{median_range([w['plain'] for w in rows], 1)} s, overhead {median_range(shares, 1)}%"
    )
    print(f"headline: flyte_overhead_pct = {statistics.median(shares):.1f}")


if __name__ == "__main__":
    main()
