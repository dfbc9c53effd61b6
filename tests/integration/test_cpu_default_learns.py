"""The CPU default really learns: held-out accuracy rises well above its warm start."""

from __future__ import annotations

import os

import pytest

from relax_core.config import load_config, replace
from relax_core.run.lifecycle import run

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 100
"""A quarter of the config's RL steps: most of the gain comes in the first hundred."""
GAIN = 0.15
"""The bar, in held-out accuracy over the warm start's (see the test)."""


# Measured beside a busy core: the shared warm start 68-112 s (when this test is the first to ask
# for it) and the 100 steps 100-122 s.
@pytest.mark.soak
@pytest.mark.timeout(600)
def test_cpu_default_raises_held_out_accuracy(workdir, cpu_default_policies):
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    cfg = replace(
        cfg,
        train={"eval_every": 0, "total_steps": STEPS, "torch_threads": 1},
        checkpoint={"policy_cache_dir": cpu_default_policies[0]},  # the shared warm start
        tracking={"tracking_uri": f"sqlite:///{workdir}/mlflow.db", "progress": False},
    )
    summary = run(cfg)
    before, after = summary["eval_accuracy_before"], summary["eval_accuracy_after"]
    # The warm start runs until the policy is right a fifth of the time on both answer lengths
    # (0.262 held-out with bf16 matmuls on an AVX512-BF16 EPYC, 0.273 in float32 on the
    # AVX2-only one), which is what RL needs.
    assert 0.1 <= before <= 0.35
    # Seed 0 over 100 steps, held-out at steps 0, 25, 50, 75, 100: 0.262, 0.477, 0.602, 0.586,
    # 0.645 (+38.3) in bf16; 0.273 ... 0.578 and 0.617 (+30.5, +34.4) in float32
    # (bench/RESULTS.md, main_vs_bare). Another machine's kernels give another trajectory, as
    # another seed does. The bar is half the smallest of these gains: 15.5 points under it and
    # 15 over no gain at all are each about 3.7 standard deviations of the difference of two
    # 256-question evals (sqrt((0.26 * 0.74 + 0.6 * 0.4) / 256) = 0.041).
    assert after >= before + GAIN, (before, after)
