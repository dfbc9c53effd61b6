"""Flyte local overhead: the same CPU-default run through `pyflyte run` and without Flyte.

Alternates `pyflyte run workflows/train.py train --cfg C` and `python -m <launcher> --cfg C`
(`bench.common.LAUNCHER`: the same run without Flyte), same config, each in a fresh empty work
directory with the warm-started policy pre-seeded in its cache, so neither pays for the warm
start, and reports wall times and the overhead share.

    python bench/flyte_overhead.py [--rounds 2] [--cfg configs/cpu-default.yaml]

Last line: `headline: flyte_overhead_pct = X` (median over rounds of (flyte - plain) / flyte).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import shutil
import statistics
import subprocess
import tempfile
import time

from bench.common import LAUNCHER
from relax_core.config import load_config


def _workdir(policies: str) -> str:
    d = tempfile.mkdtemp(prefix="flyte-overhead-")
    os.symlink(os.path.join(REPO, "datasets"), os.path.join(d, "datasets"))
    shutil.copytree(policies, os.path.join(d, ".relax", "policies"))
    os.makedirs(os.path.join(d, "tmp"))
    return d


def _timed(cmd: list[str], cwd: str) -> float:
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "TMPDIR": os.path.join(cwd, "tmp"),
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cfg", default=os.path.join(REPO, "configs", "cpu-default.yaml"))
    args = parser.parse_args()
    cfg = load_config(args.cfg)
    policies = os.path.join(REPO, cfg.checkpoint.policy_cache_dir)
    if not os.path.isdir(policies):
        raise SystemExit(f"no prepared policy under {policies}: run the config once first")
    bin_dir = os.path.dirname(sys.executable)
    flyte = [
        os.path.join(bin_dir, "pyflyte"),
        "run",
        os.path.join(REPO, "workflows", "train.py"),
        "train",
        "--cfg",
        os.path.abspath(args.cfg),
    ]
    plain = [sys.executable, "-m", LAUNCHER, "--cfg", os.path.abspath(args.cfg)]
    rows = []
    for i in range(args.rounds):
        order = [("flyte", flyte), ("plain", plain)]
        if i % 2:
            order.reverse()
        walls = {name: _timed(cmd, _workdir(policies)) for name, cmd in order}
        rows.append(walls)
        print(
            f"round {i}: pyflyte {walls['flyte']:.1f} s, plain {walls['plain']:.1f} s",
            file=sys.stderr,
            flush=True,
        )
    print(f"| round | pyflyte run (s) | python -m {LAUNCHER} (s) | overhead |")
    print("| --- | --- | --- | --- |")
    shares = []
    for i, w in enumerate(rows):
        share = 100 * (w["flyte"] - w["plain"]) / w["flyte"]
        shares.append(share)
        print(f"| {i} | {w['flyte']:.1f} | {w['plain']:.1f} | {share:.1f}% |")
    print(f"headline: flyte_overhead_pct = {statistics.median(shares):.1f}")


if __name__ == "__main__":
    main()
