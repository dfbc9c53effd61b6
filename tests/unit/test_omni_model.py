"""The tiny omni policy (models/omni.py), built in code: the rollout engine (KV cache, media at
prefill only, left-padded batch) and the train backend (whole sequences, right-padded) give the
same log-probs for the same multimodal rows; media changes what the model says; gradients reach
the encoders; a save/load round trip keeps every weight; a prompt whose placeholders do not fit
its media is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from PIL import Image

from relax_core.config import ModelConfig
from relax_core.models.omni import (
    OmniSpec,
    TinyOmni,
    add_media_token,
    load_omni,
    media_prompt_ids,
    save_omni,
)
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.multimodal.features import media_input
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import response_logprobs

SPEC = OmniSpec()
MAX_ABS_DIFF = 1e-5
"""Engine vs backend log-prob agreement (float32, CPU); measured 4.8e-7."""


@pytest.fixture(scope="module")
def policy():
    tok = build_char_tokenizer()
    media_id = add_media_token(tok)
    cfg = ModelConfig(
        kind="tiny-qwen3", hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1,
        intermediate_size=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = TinyOmni(build_tiny_qwen3(cfg, len(tok), seed=0), SPEC, media_id).eval()
    with torch.no_grad():  # give the encoders' zero-initialised position tables some signal
        for p in (model.image_pos, model.video_pos):
            p.normal_(0, 0.5)
    return model, tok, media_id


def _media():
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))
    audio = (0.3 * np.sin(2 * np.pi * 700 * np.arange(12800) / 8000)).astype(np.float32)
    video = rng.integers(0, 255, (6, 32, 32, 3), dtype=np.uint8)  # short: padded to 8 frames
    return {
        "image": media_input("image", image, SPEC),
        "audio": media_input("audio", audio, SPEC),
        "video": media_input("video", video, SPEC),
    }


def _rows(tok, media_id):
    items = _media()
    rows = [
        (["image"], "What colour?\nAnswer:"),
        (["audio"], "How many beeps?\nAnswer:"),
        (["video", "image"], "Which way?\nAnswer:"),
        ([], "1+2="),  # a text-only row in the same batch
    ]
    prompts = [media_prompt_ids(tok, text, kinds, SPEC, media_id) for kinds, text in rows]
    media = [[items[k] for k in kinds] for kinds, _ in rows]
    return prompts, media


def test_media_inputs_have_the_encoder_shapes():
    items = _media()
    assert items["image"].tensor.shape == (3, 32, 32)
    assert items["audio"].tensor.shape[0] == SPEC.n_mels
    assert items["video"].tensor.shape == (8, 3, 32, 32)
    assert [SPEC.tokens_for(k) for k in ("image", "audio", "video")] == [16, 8, 8]


def test_engine_and_backend_log_probs_agree_on_multimodal_rows(policy):
    model, tok, media_id = policy
    prompts, media = _rows(tok, media_id)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=3)
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    completions = engine.generate(prompts, params, media=media)
    responses = [c.response_ids for c in completions]
    assert all(responses)
    mb = make_micro_batch(prompts, responses, [[1] * len(r) for r in responses], tok.pad_token_id)
    mb = type(mb)(**{**mb.__dict__, "media": media})
    with torch.no_grad():
        train_lp, _ = response_logprobs(model, mb, temperature=1.0)
    for row, comp in enumerate(completions):
        n = len(comp.response_ids)
        diff = (train_lp[row, :n] - torch.tensor(comp.logprobs)).abs().max().item()
        assert diff < MAX_ABS_DIFF, (row, diff)


def test_the_media_changes_the_next_token_distribution(policy):
    model, tok, media_id = policy
    prompts, media = _rows(tok, media_id)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        with_image = model(ids, media=[media[0]]).logits[0, -1]
        other = media_input("image", Image.new("RGB", (32, 32), (0, 0, 255)), SPEC)
        with_other = model(ids, media=[[other]]).logits[0, -1]
    assert (with_image - with_other).abs().max() > 1e-3


def test_gradients_reach_every_encoder(policy, tmp_path):
    model, tok, media_id = policy
    prompts, media = _rows(tok, media_id)
    mb = make_micro_batch(prompts, [[5, 6]] * 4, [[1, 1]] * 4, tok.pad_token_id)
    mb = type(mb)(**{**mb.__dict__, "media": media})
    model.zero_grad()
    logprobs, _ = response_logprobs(model, mb, temperature=1.0)
    logprobs.sum().backward()
    encoders = ("image_in.0.weight", "audio_in.0.weight", "audio_out.weight", "video_out.weight")
    for name in (*encoders, "motion_in.weight", "glance_in.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    model.zero_grad()


def test_save_and_load_keep_every_weight(policy, tmp_path):
    model, tok, media_id = policy
    save_omni(model, str(tmp_path))
    loaded = load_omni(str(tmp_path))
    assert loaded.media_token_id == media_id and loaded.spec == SPEC
    theirs = loaded.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(theirs[name], tensor), name


def test_placeholders_must_fit_the_media(policy):
    model, tok, media_id = policy
    prompts, media = _rows(tok, media_id)
    with pytest.raises(ValueError, match=r"row 0: 8 <media> placeholders for media that take 16"):
        model(torch.tensor([prompts[1]]), media=[[media[0][0]]])
    # A <media> the policy sampled after its prompt is an ordinary token: the prompt's media
    # fill the first placeholders, and the sampled one keeps its token embedding.
    sampled = torch.tensor([prompts[0] + [media_id]])
    embeds = model.embed(sampled, [media[0]])
    token = model.lm.get_input_embeddings()(torch.tensor([media_id]))[0]
    assert torch.equal(embeds[0, -1], token)
    with pytest.raises(ValueError, match="media kind 'text' is not one of"):
        SPEC.tokens_for("text")


def test_encoder_lr_scale_moves_only_the_encoders_faster(policy, tmp_path):
    """`train.encoder_lr_scale`: the encoders' optimizer group runs at lr x scale, the LM's at
    lr, and a resumed optimizer keeps the split."""
    from relax_core.config import TrainConfig
    from relax_core.train.torch_backend import build_backend

    model, tok, media_id = policy
    model = copy.deepcopy(model).train()
    backend = build_backend(model, TrainConfig(lr=1e-3, encoder_lr_scale=8.0), temperature=1.0)
    prompts, media = _rows(tok, media_id)
    mb = make_micro_batch(prompts, [[5, 6]] * 4, [[1, 1]] * 4, tok.pad_token_id)
    mb = type(mb)(**{**mb.__dict__, "media": media})
    metrics = backend.train_step([mb], lambda lp, ent, b: (-lp.sum(), {}))
    assert metrics["lr"] == pytest.approx(1e-3)  # the run's (LM's) rate is what is reported
    rates = {}
    for group in backend.optimizer.param_groups:
        for p in group["params"]:
            rates[id(p)] = group["lr"]
    named = dict(model.named_parameters())
    assert rates[id(named["image_in.0.weight"])] == pytest.approx(8e-3)
    assert rates[id(named["motion_in.weight"])] == pytest.approx(8e-3)
    assert rates[id(named["lm.model.embed_tokens.weight"])] == pytest.approx(1e-3)
    backend.save(str(tmp_path))
    again = build_backend(model, TrainConfig(lr=1e-3, encoder_lr_scale=8.0), temperature=1.0)
    again.load(str(tmp_path))
    scales = [g["lr_scale"] for g in again.optimizer.param_groups]
    assert sorted(scales) == [1.0, 8.0]
    assert scales == [g["lr_scale"] for g in backend.optimizer.param_groups]
    assert (
        again.optimizer.state_dict()["state"].keys()
        == backend.optimizer.state_dict()["state"].keys()
    )
