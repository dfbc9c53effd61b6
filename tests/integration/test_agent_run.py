"""An agent written against the `openai` client trains through the OpenAI-compatible endpoint in a
colocate and an async run (every role an OS process): every call the agent made is in the queue's
rows token for token (its prompt ids as context, its sampled ids under loss_mask 1), the trainer
scores those tokens as the engine did, and MLflow has the agent metrics. In the async run every
call streams and ends at stop strings: the rows hold what the engine sampled up to the token that
completed the stop string, and the agent's text ends before it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlflow
import pytest

from relax_core.models.tiny import build_char_tokenizer
from relax_core.queue import TransferQueue
from relax_core.train.checkpoint import find_resume_checkpoint, read_state
from tests.agent_rows import sampled_runs

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_RUN = {
    "warm_start": {"steps": 0},
    "model": {"chat_template": os.path.join(REPO, "configs/templates/tiny-chat.jinja")},
    "data": {
        "train_path": "datasets/calculator/train.jsonl",
        "eval_path": "datasets/calculator/eval.jsonl",
        "eval_size": 4,
    },
    "env": {
        "agent": "tests.integration.openai_agents:calculator",
        "max_turns": 3,
        "max_episode_tokens": 60,
    },
    "rollout": {"n_samples_per_prompt": 2, "groups_per_step": 2, "max_new_tokens": 16},
    "train": {"total_steps": 2, "checkpoint_every": 2, "steps_per_node": 2},
}
# Characters the untrained tiny model writes often enough that many calls end on one, and a
# two-character string.
STOPS = ["e", "a", "1", "c("]


def _history(workdir, run_id: str, key: str) -> list[tuple[int, float]]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = mlflow.tracking.MlflowClient()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_an_openai_client_agent_trains_on_exactly_the_tokens_the_engine_sampled(
    small_config, workdir, mode
):
    extra = {"services": {"trainer_threads": 1, "poll_s": 0.002}} if mode == "async" else {}
    cfg = small_config("g.yaml", run_name="g", mode=mode, **AGENT_RUN, **extra)
    log = workdir / "calls.jsonl"
    env = {**os.environ, "AGENT_CALL_LOG": str(log), "PYTHONPATH": REPO}
    if mode == "async":
        env["AGENT_STREAM_STOP"] = ",".join(STOPS)
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "g"))
    assert state["policy_version"] == 2
    queue = TransferQueue(".relax/queue", state["run_id"])
    rows = [r for seq in queue.committed("rollout") for r in queue.read("rollout", seq).to_pylist()]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    tok = build_char_tokenizer()
    # Calls of trained steps are in the rows; eval episodes (greedy, never queued) are not.
    trained = [c for c in calls if any(_holds(r, c) for r in rows)]
    assert len(trained) == sum(r["turns"] for r in rows) and len(trained) >= 4
    stopped = 0
    for call in calls:
        sampled = tok.decode(call["sampled_ids"], skip_special_tokens=True)
        if mode == "async" and sampled != call["text"]:
            # Cut at a stop string: the agent got the text before it, the engine's tokens end
            # with it, and nothing it sampled after it was kept.
            assert call["finish_reason"] == "stop", call
            assert sampled[len(call["text"]) :] in STOPS and sampled.startswith(call["text"])
            assert call["sampled_ids"][-1] != tok.eos_token_id
            stopped += 1
        else:
            assert sampled == call["text"]
    assert stopped > 0 if mode == "async" else stopped == 0
    for row in rows:
        runs = sampled_runs(row)
        assert len(runs) == row["turns"]
        for context, sampled, _ in runs:
            assert any(c["prompt_ids"] == context and c["sampled_ids"] == sampled for c in calls)
    assert any(r["turns"] >= 2 for r in rows), "no episode called the tool and went on"
    run_id = state["tracking_run_id"]
    # The trainer's log-probs of the rows' sampled tokens agree with the engine's: each token
    # was scored in the context the engine generated it in.
    gaps = _history(workdir, run_id, "mismatch/kl_s0")
    assert gaps and all(abs(v) < 1e-3 for _, v in gaps), gaps
    assert [s for s, _ in _history(workdir, run_id, "rollout/mean_calls")] == [1, 2]
    assert _history(workdir, run_id, "eval/success_rate")[0][0] == 0
    assert all(v == 0 for _, v in _history(workdir, run_id, "rollout/agent_errors"))


def _holds(row: dict, call: dict) -> bool:
    return any(
        c == call["prompt_ids"] and s == call["sampled_ids"] for c, s, _ in sampled_runs(row)
    )
