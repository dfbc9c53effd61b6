"""datasets/omni.py: every question's answer is fixed by its media, and the media decodes through
relax_core.multimodal. Labels are recovered from the decoded files with plain signal processing
(no learning), so a policy that reads the media can answer every question."""

from __future__ import annotations

import filecmp
import importlib.util
import json
import os

import numpy as np
import pytest

from relax_core.data.dataset import load_prompts, write_prompts
from relax_core.multimodal import MediaLimits, decode_audio, decode_image, decode_video, read_bytes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)

LIMITS = MediaLimits()


def _image_label(pixels: np.ndarray, question: str) -> str:
    background = np.abs(pixels.astype(int) - omni.BACKGROUND).sum(axis=2) > 60
    ys, xs = np.nonzero(background)
    if "colour" in question:
        mean = pixels[background].mean(axis=0)
        return min(omni.COLOURS, key=lambda c: np.abs(mean - omni.COLOURS[c]).sum())
    box = (ys.max() - ys.min() + 1) * (xs.max() - xs.min() + 1)
    fill = background.sum() / box  # square 1.0, circle pi/4, triangle 1/2
    return "square" if fill > 0.92 else "circle" if fill > 0.66 else "triangle"


def _beeps(samples: np.ndarray, rate: int) -> str:
    window = int(0.02 * rate)
    energy = np.array(
        [np.mean(samples[i : i + window] ** 2) for i in range(0, len(samples) - window, window)]
    )
    loud = energy > 0.01
    return str(int(np.sum(loud[1:] & ~loud[:-1]) + loud[0]))


def _direction(frames: np.ndarray) -> str:
    def centre(frame):
        ys, xs = np.nonzero(frame.mean(axis=2) < 120)
        return xs.mean(), ys.mean()

    (x0, y0), (x1, y1) = centre(frames[0]), centre(frames[-1])
    if abs(x1 - x0) > abs(y1 - y0):
        return "right" if x1 > x0 else "left"
    return "down" if y1 > y0 else "up"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    out = tmp_path_factory.mktemp("omni")
    train, eval_ = omni.generate(str(out), seed=0, per_modality=24, eval_per_modality=8)
    write_prompts(train, os.path.join(out, "train.jsonl"))
    write_prompts(eval_, os.path.join(out, "eval.jsonl"))
    return out, train, eval_


def test_rows_load_as_a_prompt_dataset_with_one_medium_each(generated):
    out, train, eval_ = generated
    rows = load_prompts(os.path.join(out, "train.jsonl"))
    assert len(rows) == 72 and len(eval_) == 24
    assert {r["meta"]["modality"] for r in rows} == {"image", "audio", "video"}
    for row in rows:
        assert row["prompt"].endswith("Answer:") and len(row["media"]) == 1
        letter = row["answer"]
        assert row["choices"]["ABCD".index(letter)] == row["meta"]["label"]
    # Answers are spread over the letters, not all "A".
    assert len({r["answer"] for r in rows}) == 4


def test_every_label_is_recoverable_from_its_media(generated):
    out, train, eval_ = generated
    for row in train + eval_:
        item = row["media"][0]
        data = read_bytes(item, LIMITS, base_dir=str(out))
        modality, label = row["meta"]["modality"], row["meta"]["label"]
        if modality == "image":
            got = _image_label(np.asarray(decode_image(data, LIMITS, item)), row["prompt"])
        elif modality == "audio":
            got = _beeps(decode_audio(data, LIMITS, omni.AUDIO_RATE, item), omni.AUDIO_RATE)
        else:
            frames = decode_video(data, LIMITS, fps=omni.VIDEO_FPS, item=item)
            assert len(frames) == omni.VIDEO_FRAMES
            got = _direction(frames)
        assert got == label, (item["uri"], row["prompt"])


def test_the_same_seed_writes_the_same_dataset(generated, tmp_path):
    out, train, _ = generated
    again, _ = omni.generate(str(tmp_path), seed=0, per_modality=24, eval_per_modality=8)
    assert json.dumps(again) == json.dumps(train)
    for row in train:
        uri = row["media"][0]["uri"]
        assert filecmp.cmp(os.path.join(out, uri), os.path.join(tmp_path, uri), shallow=False), uri
