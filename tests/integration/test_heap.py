"""The garbage collector's full collections during RL steps walk what the steps made, not the
libraries and the model the task process holds (relax_core/heap.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_full_collections_in_rl_steps_skip_the_long_lived_heap(tmp_path):
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true", "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # torch, transformers and mlflow alone are well over 100k objects.
    assert result["frozen"] > 100_000, result
    assert result["walked"], "no full collection ran"
    assert max(result["walked"]) < result["frozen"] / 5, result
