"""What several bench scripts share: where a run's queue, checkpoints and MLflow store go, the
cached warm-started policy, the run config as a JSON file, and a whole local run started in a
child process.

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
