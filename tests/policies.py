"""The CPU default's starting policy (configs/cpu-default.yaml: the tiny Qwen3 after its supervised
warm start), prepared once per test session and shared by every test that starts from it.

Its warm start is the dearest step of those tests (a minute of CPU on a loaded 2-core box). The
product caches prepared policies on exactly the settings that determine them (PolicySpec.key), so
a test that points `checkpoint.policy_cache_dir` at `cpu_default_policies()` starts from the same
weights a cold cache would build, and the warm start itself is still the product's: it runs once,
in a process of its own (`prepare_policy` as the `prepare_policy` task calls it), under a lock
that both pytest-xdist workers take, in a directory they share (the session's base temp dir).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CPU_DEFAULT = REPO / "configs" / "cpu-default.yaml"
VLLM_CPU = REPO / "configs" / "vllm-cpu.yaml"

_PREPARE = """
import sys
from relax_core.config import load_config
from relax_core.data.dataset import fingerprint
from relax_core.run.lifecycle import policy_spec_for
from relax_core.run.prepare import prepare_policy

cfg = load_config(sys.argv[1])
print(prepare_policy(policy_spec_for(cfg, fingerprint(cfg.data.train_path)), sys.argv[2]))
"""


def shared_dir(tmp_path_factory) -> Path:
    """A directory every worker of this pytest session sees (the workers' base temp dirs share
    a parent; without xdist, the base temp dir itself)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def cpu_default_policies(
    tmp_path_factory, timeout_s: float = 600.0, config: Path = CPU_DEFAULT
) -> tuple[str, str]:
    """(policy cache dir, prepared policy dir) holding the starting policy of `config` (the CPU
    default's unless told; configs/vllm-cpu.yaml's is the same task at head width 32)."""
    cache = shared_dir(tmp_path_factory) / "shared-policies"
    cache.mkdir(exist_ok=True)
    with open(cache.parent / "shared-policies.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker may be preparing it right now
        try:
            done = subprocess.run(
                [sys.executable, "-c", _PREPARE, str(config), str(cache)],
                cwd=REPO,  # the config's dataset paths are relative to the repo
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if done.returncode != 0:
        raise RuntimeError(f"preparing {config.name}'s policy failed:\n{done.stderr[-4000:]}")
    return str(cache), done.stdout.strip().splitlines()[-1]
