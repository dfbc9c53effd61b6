"""What several bench scripts share: where a run's queue, checkpoints and MLflow store go, the
cached warm-started policy, the run config as a JSON file, a whole local run started in a
child process, and the method every headline's A/B rounds use: each side in a fresh process of
its own, pinned to one CPU set with one thread budget (`add_pin_args`, `cpu_set`, `run_pinned`,
`run_worker`; a worker prints `placement()` in its JSON so the parent can check it).

Imported as `bench.common` by scripts that first put the repository at the head of sys.path
(bench/queue.py would shadow the standard library's `queue` otherwise). relax_core is imported
inside the functions, so a script's `--help` needs none of it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLICY_CACHE = os.path.join(REPO, ".relax", "policies")
"""One cache of prepared (converted, warm-started) policies for every bench run."""
LAUNCHER = "relax_core.entrypoints.run"
"""What `python -m` runs for a whole local run (start, the steps or the async supervisor, finish)."""


def work_sections(work: str, **tracking: Any) -> dict[str, dict[str, Any]]:
    """Config sections (for `relax_core.config.replace`) that put a run's queue, checkpoints and
    MLflow store under `work`, with the shared policy cache; `tracking` adds tracking fields."""
    return {
        "queue": {"root": os.path.join(work, "queue")},
        "checkpoint": {
            "dir": os.path.join(work, "checkpoints"),
            "policy_cache_dir": POLICY_CACHE,
        },
        "tracking": {"tracking_uri": f"sqlite:///{work}/mlflow.db", "progress": False, **tracking},
    }


def repo_data(cfg) -> dict[str, dict[str, str]]:
    """The config's dataset paths made absolute (they are relative to the repository)."""
    return {
        "data": {
            "train_path": os.path.join(REPO, cfg.data.train_path),
            "eval_path": os.path.join(REPO, cfg.data.eval_path),
        }
    }


def prepared_policy(cfg) -> str:
    """The config's starting policy, prepared once (conversion, warm start) and then cached."""
    from relax_core.data.dataset import fingerprint
    from relax_core.run.prepare import PolicySpec, prepare_policy

    spec = PolicySpec.of(cfg, fingerprint(cfg.data.train_path))
    return prepare_policy(spec, cfg.checkpoint.policy_cache_dir)


def write_config(cfg, path: str) -> str:
    """`cfg` as the JSON file a run's `--cfg` takes; returns `path`."""
    from relax_core.config import config_to_dict

    with open(path, "w") as f:
        json.dump(config_to_dict(cfg), f)
    return path


def start_local_run(cfg_path: str, log_path: str, **env: str) -> subprocess.Popen:
    """`python -m <LAUNCHER> --cfg cfg_path` from the repository, its output into `log_path`;
    `env` adds environment variables."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": REPO, **env}
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", LAUNCHER, "--cfg", cfg_path],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            cwd=REPO,
        )


# ---------------------------------------------------------------- pinned A/B processes
# Every headline runs each side in a fresh process of its own, all of them on one CPU set with
# one thread budget (CONVENTIONS.md, Benchmarks). The parent pins the child with
# os.sched_setaffinity before it execs (so the child and everything it starts inherit the CPU
# set, whatever torch later does) and gives it the thread budget as OMP_NUM_THREADS and
# MKL_NUM_THREADS (torch's intra-op pool reads them at start). A worker reports where it ran
# (`placement()`), and `run_worker` refuses a result that ran elsewhere.


def add_pin_args(parser: Any, threads: int = 2) -> None:
    """`--cpus` (the CPU set every process of both sides runs on, e.g. "0,1" or "0-3"; all this
    process may use by default) and `--threads` (torch threads per process) on `parser`."""
    parser.add_argument("--cpus", default="", help="CPU set for every process (default: all)")
    parser.add_argument("--threads", type=int, default=threads, help="torch threads per process")


def cpu_set(spec: str) -> list[int]:
    """The CPUs of `spec` ("0,1", "0-3", "0,2-3"; "" = every CPU this process may use)."""
    if not spec.strip():
        return sorted(os.sched_getaffinity(0))
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise SystemExit(f"--cpus {spec}: CPUs {sorted(cpus - allowed)} are not available here")
    return sorted(cpus)


def pinned_env(threads: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (os.environ by default) with the thread budget set for torch/OpenMP/MKL, the
    repository on PYTHONPATH and unbuffered output."""
    return {
        **(os.environ if base is None else base),
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": REPO,
        "PYTHONUNBUFFERED": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


def run_pinned(
    cmd: list[str],
    cpus: list[int],
    threads: int,
    *,
    cwd: str = REPO,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """Run `cmd` to its end on `cpus` (its children inherit them) with `threads` threads
    (`pinned_env` over `env`); output captured as text."""
    return subprocess.run(
        cmd,
        cwd=cwd,
        env=pinned_env(threads, env),
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_worker(
    cmd: list[str], cpus: list[int], threads: int, timeout: float | None = None
) -> dict[str, Any]:
    """`run_pinned(cmd, ...)` and the JSON object its last line of stdout prints. Exits naming
    the command and its output's tail when it fails, or when the placement it reports (`cpus`,
    `threads`) is not the one asked for."""
    out = run_pinned(cmd, cpus, threads, timeout=timeout)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        raise SystemExit(
            f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n"
            f"{out.stderr[-4000:]}"
        )
    result = json.loads(lines[-1])
    ran = (result.get("cpus"), result.get("threads"))
    if ran != (cpus, threads):
        raise SystemExit(
            f"{' '.join(cmd)} ran on CPUs {ran[0]} with {ran[1]} threads, not {cpus} with {threads}"
        )
    return result


def placement() -> dict[str, Any]:
    """Where this process runs: its CPU set and torch's thread count (a worker's JSON has it)."""
    import torch

    return {"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def median_range(values: list[float], digits: int = 3) -> str:
    """ "median (min-max)" of `values`."""
    import statistics

    f = f"{{:.{digits}f}}"
    mid, lo, hi = (f.format(x) for x in (statistics.median(values), min(values), max(values)))
    return f"{mid} ({lo}-{hi})"


def print_headline(name: str, values: list[float], digits: int = 2) -> None:
    """The last lines of a headline over rounds: `name` per round as median (min-max), then
    `headline: name = X`, X the median."""
    import statistics

    print(
        f"{name} per round: {', '.join(f'{v:.{digits}f}' for v in values)}; median (min-max) "
        f"{median_range(values, digits)}"
    )
    print(f"headline: {name} = {statistics.median(values):.{digits}f}")
