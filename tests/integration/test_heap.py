"""The garbage collector's full collections during RL steps walk what the steps made, not the
libraries and the model the task process holds; and the steps reuse the memory they freed
instead of faulting it in again (relax_core/heap.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import gc, json, sys
from pathlib import Path

import torch

from relax_core.config import replace
from relax_core.run import lifecycle
from tests.integration.test_run_start import policy_of, run_config

torch.set_num_threads(1)
cfg = run_config(Path(sys.argv[1]))
cfg = replace(cfg, train={"total_steps": 4, "checkpoint_every": 100})
checkpoint = lifecycle.start_run(cfg, policy_of(cfg))
walked = []


def count_walked(phase, info):
    if phase == "start" and info["generation"] == 2:
        walked.append(len(gc.get_objects()))  # what this full collection walks


gc.callbacks.append(count_walked)
lifecycle.run_steps(cfg, checkpoint, 4)
gc.collect()
print(json.dumps({"frozen": gc.get_freeze_count(), "walked": walked}))
"""


def _run(script: str, tmp_path, _args: tuple[str, ...] = (), **env_over: str) -> dict:
    """`script` in a fresh process (without glibc malloc variables of ours) with `tmp_path` and
    `_args` as its arguments; its last line."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": REPO, **env_over}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path), *_args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_full_collections_in_rl_steps_skip_the_long_lived_heap(tmp_path):
    result = _run(SCRIPT, tmp_path)
    # torch, transformers and mlflow alone are well over 100k objects.
    assert result["frozen"] > 100_000, result
    assert result["walked"], "no full collection ran"
    assert max(result["walked"]) < result["frozen"] / 5, result


FAULTS = """
import json, resource, sys
from pathlib import Path

import torch

from relax_core.config import replace
from tests.integration.test_run_start import policy_of, run_config

torch.set_num_threads(2)  # the CPU default's budget: the second thread allocates in its own arena
cfg = run_config(Path(sys.argv[1]))
steps = int(sys.argv[2])
cfg = replace(cfg, warm_start={"steps": steps, "target_accuracy": 1.0})  # all of them
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
policy_of(cfg)  # builds the tiny model, freezes the heap, runs the supervised warm start
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_in_again(tmp_path):
    # With glibc's defaults a step's activation and gradient buffers are mapped, unmapped and
    # faulted in again at every step: on the CPU default's warm start (2 threads) 1,250-1,700
    # page faults a step, against 20-210 with freed memory kept (the whole CPU-default run at
    # width 128: 380-830k against 193k). The kept figure varies run to run because the heap
    # still grows between these steps, a different amount each run (oneDNN's per-shape kernel
    # caches are part of it, docs/operations.md), and growth is faulted in either way. The
    # steps' share is what 40 more steps add: the model, its optimizer and the first step's
    # buffers are faulted in once either way.
    def per_step(name: str, **env: str) -> float:
        short, long = (
            _run(FAULTS, tmp_path / f"{name}-{n}", **env, _args=(str(n),))["faults"]
            for n in (20, 60)
        )
        return (long - short) / 40

    kept = per_step("kept")
    default = per_step("default", RELAX_KEEP_FREED_MEMORY="0")
    assert default > 300, default  # glibc's defaults do fault the buffers in again each step
    assert kept < default / 4, (kept, default)


def test_glibc_settings_the_user_made_are_left_alone(monkeypatch):
    from relax_core import heap

    monkeypatch.setattr(heap, "_tuned", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert heap.keep_freed_memory() is False
    monkeypatch.setattr(heap, "_tuned", False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv(heap.OPT_OUT_ENV, "0")
    assert heap.keep_freed_memory() is False
