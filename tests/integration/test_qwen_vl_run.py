"""A Qwen2.5-VL run end to end on CPU: a tiny policy saved as a Hugging Face directory
(model.source), image prompts from a generated dataset, two colocate steps with a KL term (so
the reference model rebuilds the media from the rows too). The run finishes and its rows carry
the media by reference."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from relax_core.data.dataset import write_prompts
from relax_core.queue import TransferQueue
from relax_core.train.checkpoint import find_resume_checkpoint, read_state
from tests.tiny_qwen import tiny_qwen_policy

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)

QWEN_VL = {
    "warm_start": {"steps": 0},
    "data": {"train_path": "vl/train.jsonl", "eval_path": "vl/eval.jsonl", "eval_size": 2},
    "rollout": {"n_samples_per_prompt": 2, "groups_per_step": 2, "max_new_tokens": 2},
    "reward": {"name": "multiple_choice"},
    "algorithm": {"kl_coef": 0.1},
    "train": {"total_steps": 2, "checkpoint_every": 2, "steps_per_node": 2},
}


def _image_rows(workdir) -> None:
    out = workdir / "vl"
    train, eval_ = omni.generate(str(out), seed=2, per_modality=4, eval_per_modality=2)
    write_prompts([r for r in train if r["meta"]["modality"] == "image"], str(out / "train.jsonl"))
    write_prompts([r for r in eval_ if r["meta"]["modality"] == "image"], str(out / "eval.jsonl"))


def test_a_qwen_vl_run_trains_on_image_rows(small_config, workdir):
    _image_rows(workdir)
    model, tok = tiny_qwen_policy("qwen2.5-vl")
    source = workdir / "tiny-qwen2.5-vl"
    model.save_pretrained(str(source))
    tok.save_pretrained(str(source))
    model_cfg = {"kind": "qwen2.5-vl", "source": str(source), "video_fps": 4.0}
    cfg = small_config("vl.yaml", run_name="vl", model=model_cfg, **QWEN_VL)
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    state = read_state(find_resume_checkpoint(".relax/checkpoints", "vl"))
    assert state["policy_version"] == 2
    queue = TransferQueue(".relax/queue", state["run_id"])
    table = queue.read("rollout", queue.committed("rollout")[0])
    media = table.column("media").to_pylist()
    assert len(media) == 4
    assert all(len(m) == 1 and m[0]["kind"] == "image" and m[0]["bytes"] is None for m in media)
    assert all(os.path.isfile(m[0]["uri"]) for m in media)
    # Each prompt holds the image's 4 placeholders (32x32 px, 8-px patches merged 2x2).
    image_pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert all(p.count(image_pad) == 4 for p in table.column("prompt_ids").to_pylist())
    ref = queue.read("ref", queue.committed("ref")[0])
    assert ref.column("ref_logprobs").null_count == 0
