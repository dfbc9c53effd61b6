"""A run whose agents all fail stops with the agents' error instead of training nothing: the
step-0 held-out eval in colocate mode (before any training), and `env.max_failed_agent_steps`
failed steps in a row in async mode (every role an OS process; the trainer is not restarted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relax_core.train.agent_failures import AgentsFailed
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFUSAL = "one choice per call"  # the endpoint's 400 for n=2, which the agent's error carries
RUN = {
    "warm_start": {"steps": 0},
    "model": {"chat_template": os.path.join(REPO, "configs/templates/tiny-chat.jinja")},
    "data": {
        "train_path": "datasets/calculator/train.jsonl",
        "eval_path": "datasets/calculator/eval.jsonl",
        "eval_size": 2,
    },
    "env": {"max_turns": 2, "max_episode_tokens": 24, "max_failed_agent_steps": 2},
    "rollout": {"n_samples_per_prompt": 2, "groups_per_step": 1, "max_new_tokens": 8},
    "train": {"total_steps": 4, "checkpoint_every": 4, "steps_per_node": 1, "eval_every": 0},
}


def _run(cfg: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO}
    cmd = [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def test_a_held_out_eval_whose_agents_all_fail_stops_the_run_before_training(small_config):
    agent = {"agent": "tests.integration.failing_agents:refused"}
    cfg = small_config("e.yaml", run_name="e", **{**RUN, "env": {**RUN["env"], **agent}})
    proc = _run(cfg)
    assert proc.returncode == AgentsFailed.exit_code, proc.stderr[-5000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: every agent episode of the held-out eval failed (2 of 2)")
    assert REFUSAL in error and "env.max_failed_agent_steps" in error
    assert find_resume_checkpoint(".relax/checkpoints", "e") is None  # nothing was trained


def test_failed_agent_steps_in_a_row_stop_an_async_run_without_restarts(small_config, workdir):
    agent = {"agent": "tests.integration.failing_agents:refused_in_training"}
    services = {"launch": "processes", "trainer_threads": 1, "poll_s": 0.002}
    cfg = small_config(
        "a.yaml",
        run_name="a",
        mode="async",
        services=services,
        **{**RUN, "env": {**RUN["env"], **agent}},
    )
    proc = _run(cfg)
    assert proc.returncode == AgentsFailed.exit_code, proc.stderr[-5000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(
        "error: trainer-0: every agent episode failed in 2 steps in a row "
        "(env.max_failed_agent_steps: 2)"
    ), error
    assert REFUSAL in error
    # Stopped by the trainer's second failed step, not restarted into a third: the step-0
    # checkpoint is the newest, and the supervisor recorded no recovery.
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "a"))
    assert state["policy_version"] <= 1
    recovery = list(workdir.glob(".relax/**/recovery.json"))
    assert recovery and all(json.loads(p.read_text())["events"] == [] for p in recovery)
