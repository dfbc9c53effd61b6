"""An omni-modal run end to end, colocate and async (every role an OS process, the reference role
included): media prompts from a generated dataset with one corrupt clip and one missing video. The
bad rows are quarantined with their reason and the run goes on; queue rows carry media by
reference; MLflow has accuracy per modality at step 0 and at the end, held-out and on training
rollouts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import mlflow
import pytest

from relax_core.data.dataset import write_prompts
from relax_core.queue import TransferQueue
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)

OMNI = {
    "model": {"kind": "tiny-omni", "image_size": 16, "patch_size": 8, "video_frames": 4},
    "warm_start": {"steps": 2, "batch_size": 8},
    "data": {"train_path": "omni/train.jsonl", "eval_path": "omni/eval.jsonl", "eval_size": 0},
    "rollout": {"n_samples_per_prompt": 2, "groups_per_step": 3, "max_new_tokens": 2},
    "reward": {"name": "multiple_choice"},
    # A KL term brings in the reference role, which rebuilds media from the rows too.
    "algorithm": {"kl_coef": 0.1},
    "train": {"total_steps": 3, "checkpoint_every": 3, "steps_per_node": 3, "encoder_lr_scale": 10},
}
KINDS = ("audio", "image", "video")


def _dataset(workdir):
    out = workdir / "omni"
    train, eval_ = omni.generate(str(out), seed=1, per_modality=6, eval_per_modality=2)
    (out / train[7]["media"][0]["uri"]).write_bytes(b"RIFF but not a clip")  # audio
    os.remove(out / train[13]["media"][0]["uri"])  # video
    write_prompts(train, str(out / "train.jsonl"))
    write_prompts(eval_, str(out / "eval.jsonl"))


def _run(cfg: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _history(workdir, run_id: str, key: str) -> list[tuple[int, float]]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = mlflow.tracking.MlflowClient()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


@pytest.mark.parametrize("mode", ["colocate", "async"])
def test_an_omni_run_quarantines_bad_media_and_reports_each_modality(small_config, workdir, mode):
    _dataset(workdir)
    extra = {"services": {"trainer_threads": 1, "poll_s": 0.002}} if mode == "async" else {}
    cfg = small_config("o.yaml", run_name="o", mode=mode, **OMNI, **extra)
    _run(cfg)
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "o"))
    assert state["policy_version"] == 3
    queue = TransferQueue(".relax/queue", state["run_id"])
    record = json.loads(queue.store.read_bytes("quarantine/prompts/train.json"))
    assert [q["index"] for q in record["quarantined"]] == [7, 13]
    assert "unreadable audio" in record["quarantined"][0]["reason"]
    assert "not found" in record["quarantined"][1]["reason"]
    # Rows hold references (kind + the file's path), never decoded media or inline bytes.
    seq = queue.committed("rollout")[0]
    table = queue.read("rollout", seq)
    media = table.column("media").to_pylist()
    assert all(len(m) == 1 and m[0]["bytes"] is None for m in media)
    assert all(os.path.isfile(m[0]["uri"]) for m in media)
    ref = queue.read("ref", queue.committed("ref")[0])
    assert ref.column("ref_logprobs").null_count == 0
    run_id = state["tracking_run_id"]
    for kind in KINDS:
        steps = [s for s, _ in _history(workdir, run_id, f"eval/accuracy/{kind}")]
        assert steps[0] == 0 and steps[-1] == 3, (kind, steps)
    trained = {k for k in KINDS if _history(workdir, run_id, f"train/accuracy/{k}")}
    assert trained, "no train/accuracy/<modality> was logged"
