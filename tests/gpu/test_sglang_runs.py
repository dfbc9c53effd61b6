"""End to end on a GPU machine with SGLang: the runs the CPU tests drive through a stand-in
server (tests/integration/test_sglang_engine_run.py), here against `sglang.launch_server` itself.

Needs CUDA and SGLang's own venv (it pins its own torch): RELAX_SGLANG_PYTHON names its Python,
e.g. /opt/sglang/bin/python (containers/rollout builds one). The policy is the tests' tiny Qwen3
saved as an HF directory, so nothing is downloaded.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = [pytest.mark.gpu, pytest.mark.integration, pytest.mark.slow]

SGLANG_PYTHON = os.environ.get("RELAX_SGLANG_PYTHON", "")


@pytest.fixture
def sglang_python():
    if not SGLANG_PYTHON:
        pytest.skip("RELAX_SGLANG_PYTHON names no SGLang venv")
    probe = subprocess.run([SGLANG_PYTHON, "-c", "import sglang"], capture_output=True)
    if probe.returncode:
        pytest.skip(f"{SGLANG_PYTHON} cannot import sglang")
    return SGLANG_PYTHON


def _run(cfg: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]


def test_async_run_on_sglang_servers_over_nccl(small_config, workdir, sglang_python):
    if torch.cuda.device_count() < 2:  # the trainer on one GPU, its SGLang server on another
        pytest.skip(
            f"needs 2 GPUs (the trainer's and the SGLang server's), this machine has "
            f"{torch.cuda.device_count()}"
        )
    total = 8
    cfg = small_config(
        "gpu-async.yaml",
        run_name="gpu-async",
        mode="async",
        rollout={"engine": "sglang", "max_staleness": 1},
        train={"total_steps": total, "checkpoint_every": 500},
        services={"sync_backend": "nccl", "rollout_workers": 1, "heartbeat_s": 1.0},
        sglang={"python": sglang_python, "mem_fraction_static": 0.3, "start_timeout_s": 600},
    )
    _run(cfg)
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "gpu-async"))
    assert state["policy_version"] == total
    queue = TransferQueue(".relax/queue", state["run_id"])
    audit = audit_run(queue, state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    versions = [
        queue.record("rollout", s)["meta"]["policy_version"] for s in queue.committed("rollout")
    ]
    assert max(versions) >= total - 2  # the servers took the trainer's updates


def test_colocate_run_shares_the_gpu_with_sglang(small_config, workdir, sglang_python):
    total = 4
    cfg = small_config(
        "gpu-colocate.yaml",
        run_name="gpu-colocate",
        rollout={"engine": "sglang"},
        train={"total_steps": total, "checkpoint_every": 500, "steps_per_node": 10},
        sglang={
            "python": sglang_python,
            "mem_fraction_static": 0.3,
            "start_timeout_s": 600,
            "handoff_dir": str(workdir / "handoff"),
        },
    )
    _run(cfg)
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "gpu-colocate"))
    assert state["policy_version"] == total
