"""Qwen VL rows through the roles, as omni rows go (test_omni_roles.py): prompts hold each
medium's start token, as many placeholders as its processed input takes and its end token; videos
are sampled at model.video_fps; media the model cannot read are quarantined with their reason; and
the trainer's micro-batches, rebuilt from the rows' media references, score the responses as the
rollout engine did."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch

from relax_core.config import RunConfig, replace
from relax_core.data.dataset import write_prompts
from relax_core.queue import TransferQueue, rows_to_table
from relax_core.rewards.registry import build_reward
from relax_core.roles.media import QUARANTINE, prompt_source, resolver_for
from relax_core.roles.rollout import rollout_groups
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batching import table_micro_batches
from relax_core.train.torch_backend import response_logprobs
from tests.tiny_qwen import tiny_qwen_policy

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)

MAX_ABS_DIFF = 1e-4


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    """Image, audio and video rows (32x32 PNGs; 8-frame 8 fps MP4s) and a tiny Qwen2.5-VL."""
    out = tmp_path_factory.mktemp("qwen")
    train, eval_ = omni.generate(str(out), seed=0, per_modality=3, eval_per_modality=1)
    write_prompts(train, str(out / "train.jsonl"))
    write_prompts(eval_, str(out / "eval.jsonl"))
    cfg = replace(
        RunConfig(),
        model={"kind": "qwen2.5-vl", "source": str(out / "policy"), "video_fps": 8.0},
        warm_start={"steps": 0},
        data={"train_path": str(out / "train.jsonl"), "eval_path": str(out / "eval.jsonl")},
        rollout={"n_samples_per_prompt": 2, "max_new_tokens": 3},
        reward={"name": "multiple_choice"},
    )
    model, tok = tiny_qwen_policy("qwen2.5-vl")
    return cfg, model, tok, train


def _source(vl_run, tmp_path):
    cfg, model, tok, _ = vl_run
    return prompt_source(cfg, "train", model, tok, TransferQueue(str(tmp_path / "q"), "r"))


def _items(source):
    return source.at(0, len(source.rows))


def test_an_image_prompt_holds_its_images_placeholders(vl_run, tmp_path):
    _, model, tok, _ = vl_run
    source = _source(vl_run, tmp_path)
    item = next(it for it in _items(source) if it.row["media"][0]["kind"] == "image")
    # A 32x32 PNG in 8-px patches is a 4x4 grid; merged 2x2, it takes 4 tokens.
    (image,) = item.media
    assert image.inputs["image_grid_thw"].tolist() == [[1, 4, 4]] and image.tokens == 4
    s = model.special
    text = tok(item.row["prompt"], add_special_tokens=False)["input_ids"]
    assert item.prompt_ids == [s.vision_start, *[s.image] * 4, s.vision_end, *text]


def test_videos_are_sampled_at_the_runs_video_fps(vl_run, tmp_path):
    _, model, _, _ = vl_run
    source = _source(vl_run, tmp_path)
    item = next(it for it in _items(source) if it.row["media"][0]["kind"] == "video")
    # 1 s at model.video_fps 8 (the policy's own processor says 4): 8 frames, 2 per temporal
    # patch -> 4 patches of a 4x4 grid, 4 tokens each.
    assert model.processor.video_fps == 4.0
    (video,) = item.media
    assert video.inputs["video_grid_thw"].tolist() == [[4, 4, 4]]
    assert video.seconds_per_grid == 2 / 8
    assert item.prompt_ids.count(model.special.video) == 16


def test_media_the_model_cannot_read_are_quarantined(vl_run, tmp_path):
    cfg, model, tok, train = vl_run
    queue = TransferQueue(str(tmp_path / "q"), "r")
    source = prompt_source(cfg, "train", model, tok, queue)
    assert {row["media"][0]["kind"] for row in source.rows} == {"image", "video"}
    record = json.loads(queue.store.read_bytes(f"{QUARANTINE}/train.json"))
    audio = [i for i, row in enumerate(train) if row["media"][0]["kind"] == "audio"]
    assert [q["index"] for q in record["quarantined"]] == audio
    assert "the policy reads image, video, not audio" in record["quarantined"][0]["reason"]


def test_the_trainer_rebuilds_the_rollouts_media_from_the_rows(vl_run, tmp_path):
    cfg, model, tok, _ = vl_run
    source = _source(vl_run, tmp_path)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    items = _items(source)
    params = SamplingParams(max_new_tokens=3)
    rows, _ = rollout_groups(engine, tok, items, params, 2, build_reward(cfg.reward))
    table = rows_to_table(rows)
    media = table.column("media").to_pylist()
    assert all(m[0]["uri"].startswith("/") and m[0]["bytes"] is None for m in media)
    # A fresh resolver, as in a trainer process: media decoded again from the references, in
    # micro-batches of a few rows each.
    resolver = resolver_for(cfg, model)
    budget = 3 * max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    batches = table_micro_batches(table, tok.pad_token_id, budget, resolver=resolver)
    assert len(batches) > 1
    with torch.no_grad():
        for idx, mb in batches:
            logprobs, _ = response_logprobs(model, mb, 1.0)
            for j, i in enumerate(idx):
                n = len(rows[i]["response_ids"])
                engine_lp = torch.tensor(rows[i]["rollout_logprobs"])
                assert (logprobs[j, :n] - engine_lp).abs().max() <= MAX_ABS_DIFF
    assert resolver.decoded == len(items)


def test_a_chat_prompt_shows_the_media_at_the_start_of_the_users_message(vl_run, tmp_path):
    cfg, model, tok, _ = vl_run
    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    chat = replace(cfg, data={"template": "chat"})
    source = prompt_source(chat, "train", model, chat_tok, TransferQueue(str(tmp_path / "q"), "r"))
    item = next(it for it in _items(source) if it.row["media"][0]["kind"] == "image")
    s = model.special

    def ids(text: str) -> list[int]:
        return chat_tok(text, add_special_tokens=False)["input_ids"]

    media = [s.vision_start, *[s.image] * 4, s.vision_end]
    assert item.prompt_ids == ids("user: ") + media + ids(f"{item.row['prompt']}\nassistant:")
