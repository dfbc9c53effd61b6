"""The garbage collector's full collections during RL steps walk what the steps made, not the
libraries and the model the task process holds; and a step's buffers reuse the memory the
previous step freed instead of faulting it in again (relax_core/heap.py)."""

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


def _run(script: str, tmp_path, **env_over: str) -> dict:
    """`script` in a fresh process (without glibc malloc variables of ours) with `tmp_path` as
    its argument; its last line."""
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": REPO, **env_over}
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_full_collections_in_rl_steps_skip_the_long_lived_heap(tmp_path):
    result = _run(SCRIPT, tmp_path)
    # torch, transformers and mlflow alone are well over 100k objects.
    assert result["frozen"] > 100_000, result
    assert result["walked"], "no full collection ran"
    assert max(result["walked"]) < result["frozen"] / 5, result


STEP_BUFFERS = """
import ctypes, ctypes.util, json, resource, threading

import torch  # noqa: F401 - a task process holds torch when it freezes its heap

from relax_core.heap import freeze_heap

freeze_heap()  # what a task does once its imports and model are in place
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
BLOCK, BLOCKS, STEPS = 4 << 20, 8, 4


def steps(faults):
    for _ in range(STEPS):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        buffers = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
        for b in buffers:
            ctypes.memset(b, 1, BLOCK)
        for b in reversed(buffers):
            libc.free(b)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)


main, other = [], []
steps(main)
thread = threading.Thread(target=steps, args=(other,))
thread.start()
thread.join()
print(json.dumps({"main": main, "thread": other}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_training_steps_reuse_freed_memory_instead_of_faulting_it_in_again(tmp_path):
    # A step's activation and gradient buffers, as torch's CPU allocator asks glibc for them:
    # 8 blocks of 4 MiB written, then freed, step after step, in the main thread and in a second
    # one (a second torch thread allocates in an arena of its own). Straight malloc calls, so
    # no small allocation of Python's or torch's lands between them and pins the heap's top:
    # the page faults are then the same every run (minor faults count pages, not time, so load
    # does not move them). Through torch tensors, glibc's defaults kept the memory in some runs
    # and gave it back in others, and real training steps fault in what the heap grows by.
    kept = _run(STEP_BUFFERS, tmp_path)
    default = _run(STEP_BUFFERS, tmp_path, RELAX_KEEP_FREED_MEMORY="0")
    for where in ("main", "thread"):
        first, *later = kept[where]
        # The first step faults its 32 MiB in (8,192 pages); the next ones reuse it: 0 measured.
        assert first > 0 and max(later) < first / 100, (where, kept, default)
        # glibc's defaults give the freed buffers back and fault them in again every step
        # (measured: 8,160 of 8,192 pages in the main thread, 7,136 in the second).
        first, *later = default[where]
        assert min(later) > first / 2, (where, kept, default)


def test_glibc_settings_the_user_made_are_left_alone(monkeypatch):
    from relax_core import heap

    monkeypatch.setattr(heap, "_tuned", False)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert heap.keep_freed_memory() is False
    monkeypatch.setattr(heap, "_tuned", False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv(heap.OPT_OUT_ENV, "0")
    assert heap.keep_freed_memory() is False
