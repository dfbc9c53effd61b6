"""MediaResolver: rows' media references -> the omni policy's encoder inputs, decoded once per
reference; rows with missing or corrupt media are set aside with a reason, the others go on."""

from __future__ import annotations

import importlib.util
import os

import torch

from relax_core.models.omni import OmniSpec
from relax_core.multimodal import MediaLimits
from relax_core.multimodal.inputs import MediaResolver, split_by_media

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)


def test_rows_resolve_to_encoder_inputs_once_per_reference(tmp_path):
    train, _ = omni.generate(str(tmp_path), per_modality=2, eval_per_modality=0)
    resolver = MediaResolver(OmniSpec(), MediaLimits(), base_dir=str(tmp_path))
    by_kind = {}
    for row in train + train:  # every prompt twice, as a group's samples would be
        (item,) = resolver.inputs(row["media"])
        by_kind[item.kind] = item.tensor.shape
    assert resolver.decoded == len(train)  # the second pass came from the cache
    assert by_kind["image"] == (3, 32, 32) and by_kind["video"] == (8, 3, 32, 32)
    assert by_kind["audio"][0] == 32
    image_row = next(r for r in train if r["meta"]["modality"] == "image")
    inline = {"kind": "image", "bytes": (tmp_path / image_row["media"][0]["uri"]).read_bytes()}
    from_bytes = resolver.inputs([inline])[0].tensor  # the same picture, carried inline
    assert torch.equal(from_bytes, resolver.inputs(image_row["media"])[0].tensor)


def test_missing_or_corrupt_media_quarantines_its_row_and_the_rest_go_on(tmp_path):
    train, _ = omni.generate(str(tmp_path), per_modality=2, eval_per_modality=0)
    (tmp_path / train[2]["media"][0]["uri"]).write_bytes(b"\x00garbage")  # an audio clip
    os.remove(tmp_path / train[4]["media"][0]["uri"])  # a video
    resolver = MediaResolver(OmniSpec(), MediaLimits(), base_dir=str(tmp_path))
    usable, quarantined = split_by_media(train, resolver)
    assert len(usable) == 4 and [row for row, _ in usable] == [train[i] for i in (0, 1, 3, 5)]
    reasons = [reason for _, reason in quarantined]
    assert reasons[0].startswith(f"audio {train[2]['media'][0]['uri']}: unreadable audio")
    video = train[4]["media"][0]["uri"]
    assert reasons[1] == f"video {video}: not found ({tmp_path}/{video})"


def test_eval_reports_accuracy_per_modality():
    from relax_core.roles.evaluation import accuracy_by_modality

    rows = [
        {"meta": {"modality": "image"}},
        {"meta": {"modality": "image"}},
        {"meta": {"modality": "audio"}},
        {"meta": {}},
        {},
    ]
    got = accuracy_by_modality("eval", rows, [True, False, True, False, True])
    assert got == {"eval/accuracy/audio": 1.0, "eval/accuracy/image": 0.5}
    assert accuracy_by_modality("eval", [{"meta": {}}], [True]) == {}  # text runs: no extra keys
