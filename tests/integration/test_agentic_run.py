"""An agentic run end to end, colocate and async (every role an OS process): calculator episodes
become queue rows whose loss_mask is 1 on exactly the model's turns and 0 on the tool's
observations, `turns` is filled, and MLflow has the held-out success rate at step 0 and at the
end plus mean turns and tool-call validity per step."""

from __future__ import annotations

import json
import subprocess
import sys

import mlflow
import pytest

from relax_core.models.tiny import build_char_tokenizer
from relax_core.queue import TransferQueue
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.integration

AGENTIC = {
    # Enough for the small model to learn the episode's format (calc(...), then Answer: ...),
    # not the products: rows have tool observations to mask.
    "warm_start": {"steps": 40, "lr": 0.01, "batch_size": 16},
    "data": {
        "train_path": "datasets/calculator/train.jsonl",
        "eval_path": "datasets/calculator/eval.jsonl",
        "eval_size": 4,
    },
    "env": {"name": "calculator", "max_turns": 2, "max_episode_tokens": 48},
    "rollout": {"n_samples_per_prompt": 2, "groups_per_step": 2, "max_new_tokens": 16},
    "train": {"total_steps": 2, "checkpoint_every": 2, "steps_per_node": 2},
}


def _run(cfg: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _history(workdir, run_id: str, key: str) -> list[tuple[int, float]]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = mlflow.tracking.MlflowClient()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _model_spans(tok, row: dict) -> list[int]:
    """The loss mask a row must have: 1 on each turn's tokens and its EOS, 0 on what follows
    each turn up to the next one, recomputed from the tokens alone (the observation is the
    tool's line the env answered the turn with)."""
    info = json.loads(row["reward_info"])
    ids, eos, mask, at = row["response_ids"], tok.eos_token_id, [], 0
    for t in range(row["turns"]):
        end = ids.index(eos, at) + 1 if eos in ids[at:] else len(ids)
        mask += [1] * (end - at)
        at = end
        if t < len(info["turn_info"]) and at < len(ids):
            step = info["turn_info"][t]
            shown = step.get("result") or f"error: {step.get('error', '').split(':')[0]}"
            obs = tok(f"\ntool: {shown}\n", add_special_tokens=False)["input_ids"]
            assert ids[at : at + len(obs)] == obs, (tok.decode(ids[at:]), shown)
            mask += [0] * len(obs)
            at += len(obs)
    assert at == len(ids)
    return mask


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_an_agentic_run_trains_on_model_turns_and_logs_episode_metrics(small_config, workdir, mode):
    extra = {"services": {"trainer_threads": 1, "poll_s": 0.002}} if mode == "async" else {}
    cfg = small_config("a.yaml", run_name="a", mode=mode, **AGENTIC, **extra)
    _run(cfg)
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "a"))
    assert state["policy_version"] == 2
    queue = TransferQueue(".relax/queue", state["run_id"])
    tok = build_char_tokenizer()
    rows = [r for seq in queue.committed("rollout") for r in queue.read("rollout", seq).to_pylist()]
    assert rows and all(r["turns"] >= 1 for r in rows)
    assert any(0 in r["loss_mask"] for r in rows), "no episode showed an observation"
    for row in rows:
        assert row["loss_mask"] == _model_spans(tok, row), row
        assert len(row["response_ids"]) <= 48
        pairs = zip(row["rollout_logprobs"], row["loss_mask"], strict=True)
        assert all(lp == 0.0 for lp, m in pairs if not m)
    run_id = state["tracking_run_id"]
    steps = [s for s, _ in _history(workdir, run_id, "eval/success_rate")]
    assert steps[0] == 0 and steps[-1] == 2, steps
    assert [s for s, _ in _history(workdir, run_id, "rollout/mean_turns")] == [1, 2]
    assert _history(workdir, run_id, "eval/mean_turns")
    # Tool-call validity is logged whenever a step's episodes made a tool call.
    logged = _history(workdir, run_id, "rollout/tool_call_validity")
    calls = _history(workdir, run_id, "rollout/tool_calls")
    assert len(logged) == sum(v > 0 for _, v in calls)
