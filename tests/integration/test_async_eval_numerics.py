"""The async trainer evaluates its own float32 weights under the trainer's autocast
(`model.matmul_dtype`): on the same weights it scores the held-out split exactly as a colocate
run's engine copy (bf16 linear layers, float32 attention) does, so an async run's eval curve and
a colocate run's mean the same thing."""

from __future__ import annotations

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

import pytest
import torch

from relax_core.queue import TransferQueue
from relax_core.roles.service import RoleContext
from relax_core.roles.trainer_service import AsyncTrainer
from relax_core.run import lifecycle
from relax_core.train.checkpoint import read_state
from tests.integration.test_run_start import policy_of, run_config

pytestmark = [pytest.mark.integration]

KEYS = ("eval/accuracy", "eval/reward_mean", "eval/response_length", "eval/size")


@pytest.mark.slow
def test_the_async_trainers_eval_equals_the_colocate_engines_on_the_same_weights(tmp_path):
    cfg = run_config(
        tmp_path,
        "cpu-async.yaml",
        eval_size=128,
        # A short warm start: a policy that answers some of the split right, so the two evals
        # have right and wrong answers, lengths and rewards to agree on. Until a twentieth of
        # the probe is right, not a step count: kernels differ by CPU, and 60 steps left an
        # AVX2-only machine's policy at 0 of 128.
        warm_start={"steps": 300, "target_accuracy": 0.05, "target_per_length": False},
        services={"weight_sync": "object_store", "trainer_threads": 2},
        model={"matmul_dtype": "bfloat16"},  # named: 'auto' is float32 on an AVX2-only CPU
    )
    # start_run scores step 0 with a colocate engine: the session's inference copy.
    checkpoint = lifecycle.start_run(cfg, policy_of(cfg))
    state = read_state(checkpoint)
    colocate = state["eval_before"]

    queue = TransferQueue(cfg.queue.root, state["run_id"])
    ctx = RoleContext("trainer", 0, cfg, state["run_id"], checkpoint, queue)
    trainer = AsyncTrainer(ctx)
    ours = trainer.evaluate()

    assert 0.0 < colocate["eval/accuracy"] < 1.0, colocate  # something to agree on
    assert {k: ours[k] for k in KEYS} == {k: colocate[k] for k in KEYS}
    # The trainer's weights stay float32 and in training mode after its eval.
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert trainer.model.training
