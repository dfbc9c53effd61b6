"""The algorithm suite inside real colocate runs: what each knob leaves in the queue and the
metrics (small model, a few steps)."""

from __future__ import annotations

import json

import mlflow
import pytest

from relax_core.config import load_config
from relax_core.queue import TransferQueue, table_to_rows
from relax_core.run.lifecycle import run
from relax_core.train.checkpoint import find_resume_checkpoint

pytestmark = pytest.mark.integration


def _metric_keys(workdir, run_id: str) -> set[str]:
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    return set(client.get_run(run_id).data.metrics)


def test_sapo_with_dynamic_sampling_and_overlong_penalty_then_distillation(small_config, workdir):
    cfg = load_config(
        small_config(
            "a.yaml",
            run_name="sapo",
            algorithm={"loss": "sapo", "is_mode": "tis"},
            rollout={"dynamic_sampling": True, "max_sampling_rounds": 3},
            reward={"overlong_buffer": 2, "overlong_penalty": 0.5},
            train={"total_steps": 3, "steps_per_node": 3},
        )
    )
    summary = run(cfg)
    queue = TransferQueue(cfg.queue.root, summary["run_id"])
    rows = [r for s in queue.committed("ready") for r in table_to_rows(queue.read("ready", s))]
    # Dynamic sampling: every trained group has differing rewards.
    by_group: dict[str, list[float]] = {}
    for row in rows:
        by_group.setdefault(row["group_id"], []).append(row["reward"])
    assert by_group and all(max(v) > min(v) for v in by_group.values())
    # Overlong penalty: budget 4, buffer 2 -> 3 tokens cost 0.25, 4 tokens 0.5.
    for row in rows:
        n = len(row["response_ids"])
        expected = {3: 0.25, 4: 0.5}.get(n, 0.0)
        info = json.loads(row["reward_info"])
        assert info.get("overlong_penalty", 0.0) == pytest.approx(expected)
        base = 1.0 if info["correct"] else 0.0
        assert row["reward"] == pytest.approx(base - expected)
    keys = _metric_keys(workdir, summary["mlflow_run_id"])
    for key in (
        "rollout/sampling_rounds",
        "rollout/filtered_groups",
        "rollout/unfilled_groups",
        "train/gate_mean",
        "train/is_weight_mean",
        "train/rollout_train_kl",
    ):
        assert key in keys, key

    teacher = find_resume_checkpoint(cfg.checkpoint.dir, "sapo")
    student = load_config(
        small_config(
            "b.yaml",
            run_name="distill",
            algorithm={"advantage": "none", "distill_coef": 0.5, "teacher": teacher},
            train={"total_steps": 2, "steps_per_node": 2},
        )
    )
    summary = run(student)
    queue = TransferQueue(student.queue.root, summary["run_id"])
    row = table_to_rows(queue.read("ready", queue.committed("ready")[0]))[0]
    # Teacher-only signal: advantage per token = -0.5 * (student logp - teacher logp).
    expected = [
        -0.5 * (s - t)
        for s, t in zip(row["rollout_logprobs"], row["teacher_logprobs"], strict=True)
    ]
    assert row["advantages"] == pytest.approx(expected, abs=1e-6)
    assert any(abs(a) > 0 for a in row["advantages"])
