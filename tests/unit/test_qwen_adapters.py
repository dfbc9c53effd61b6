"""Qwen2.5-VL, Qwen3-VL and the Qwen2.5-Omni / Qwen3-Omni-MoE thinkers from transformers, tiny
and built in code (no download), driven through multimodal/qwen: the rollout engine (left-padded
prefill with media, KV-cache decode) and the train backend (right-padded whole sequences) give the
same log-probs for image, video, audio and text rows in one batch, also after a mid-generation
cache rebuild; gradients reach the vision and audio towers (and DeepStack's mergers); placeholders
that do not fit the media are refused; a saved policy loads back through from_pretrained; and a
prompt's logits equal those of the transformers model's own forward (its embedding merge,
get_rope_index and DeepStack)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from relax_core.models.policy import load_policy
from relax_core.multimodal.qwen import FAMILIES, QwenPolicy
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import response_logprobs
from tests.tiny_qwen import tiny_qwen_policy

MAX_ABS_DIFF = 1e-5
"""Engine vs backend log-prob agreement (float32, CPU); measured 4.8e-7 for every family, one
float32 step at these log-probs (about -4.5)."""


@pytest.fixture(scope="module", params=list(FAMILIES))
def policy(request):
    return tiny_qwen_policy(request.param)


def _media(policy: QwenPolicy) -> dict:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (32, 48, 3), dtype=np.uint8))
    video = rng.integers(0, 255, (5, 32, 32, 3), dtype=np.uint8)  # odd: last frame repeated
    p = policy.processor
    out = {"image": p.media_input("image", image), "video": p.media_input("video", video)}
    if "audio" in policy.family.modalities:
        t = np.arange(8000) / 16000
        out["audio"] = p.media_input("audio", (0.3 * np.sin(2 * np.pi * 440 * t)).astype("f4"))
    return out


def _rows(policy: QwenPolicy, tok):
    items = _media(policy)
    kinds = [["image"], ["video"], ["image", "video"], []]
    if "audio" in items:
        kinds[2:2] = [["audio"], ["video", "audio"]]
    prompts, media = [], []
    for row_kinds in kinds:
        row = [items[k] for k in row_kinds]
        text = tok("What is it?\nAnswer:", add_special_tokens=False)["input_ids"]
        prompts.append(policy.processor.media_prompt_ids(text, row))
        media.append(row)
    return prompts, media


def _backend_logprobs(policy, tok, prompts, responses, media):
    mb = make_micro_batch(prompts, responses, [[1] * len(r) for r in responses], tok.pad_token_id)
    return response_logprobs(policy, dataclasses.replace(mb, media=media), temperature=1.0)[0]


def _max_diff(train_lp, completions) -> float:
    return max(
        (train_lp[row, : len(c.logprobs)] - torch.tensor(c.logprobs)).abs().max().item()
        for row, c in enumerate(completions)
    )


def test_the_processor_counts_each_mediums_placeholders(policy):
    model, _ = policy
    items = _media(model)
    # 32x48 image, 8-px patches merged 2x2: a 4x6 grid -> 6 tokens.
    assert items["image"].inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert items["image"].runs == [6]
    # 5 frames -> 6 (last repeated) -> 3 temporal patches of a 4x4 grid, 4 tokens each.
    assert items["video"].inputs["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert items["video"].inputs["pixel_values_videos"].shape == (48, 3 * 2 * 8 * 8)
    timestamps = model.family.frame_timestamps
    assert items["video"].runs == ([4, 4, 4] if timestamps else [12])
    if "audio" in items:  # 0.5 s at 16 kHz, 10 ms hops: 50 feature frames
        assert int(items["audio"].inputs["feature_attention_mask"].sum()) == 50
        # Qwen2.5-Omni: (50-1)//2+1 = 25, (25-2)//2+1 = 12; Qwen3-Omni (100-frame windows):
        # 25 -> 13 -> 7.
        assert items["audio"].runs == ([7] if model.family.kind == "qwen3-omni" else [12])


def test_engine_and_backend_log_probs_agree(policy):
    model, tok = policy
    prompts, media = _rows(model, tok)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=3)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=6), media=media)
    responses = [c.response_ids for c in completions]
    assert all(responses)
    with torch.no_grad():
        train_lp = _backend_logprobs(model, tok, prompts, responses, media)
    diff = _max_diff(train_lp, completions)
    print(f"{model.family.kind}: engine vs backend max |dlogp| = {diff:.2e}")
    assert diff <= MAX_ABS_DIFF


def test_log_probs_agree_after_a_cache_rebuild(policy):
    """A weight update mid-generation rebuilds the KV cache by one prefill of prompt + tokens so
    far, with media and multimodal positions recomputed over the longer rows."""
    model, tok = policy
    prompts, media = _rows(model, tok)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=4)
    polls = iter([False, True])
    engine.weight_poll = lambda: next(polls, False)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=5), media=media)
    responses = [c.response_ids for c in completions]
    with torch.no_grad():
        train_lp = _backend_logprobs(model, tok, prompts, responses, media)
    assert _max_diff(train_lp, completions) <= MAX_ABS_DIFF


def test_the_media_changes_the_next_token_distribution(policy):
    model, tok = policy
    prompts, media = _rows(model, tok)
    other = model.processor.media_input("image", Image.new("RGB", (48, 32), (0, 0, 255)))
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        a = model(ids, media=[media[0]]).logits[0, -1]
        b = model(ids, media=[[other]]).logits[0, -1]
    assert (a - b).abs().max() > 1e-4


def test_gradients_reach_the_media_towers(policy):
    model, tok = policy
    prompts, media = _rows(model, tok)
    responses = [[5, 6]] * len(prompts)
    model.zero_grad()
    _backend_logprobs(model, tok, prompts, responses, media).sum().backward()
    inner = model.hf.model
    # Each tower's input layer: a gradient there went through the whole tower.
    reached = {"vision patch embedding": inner.visual.patch_embed.proj.weight}
    if "audio" in model.family.modalities:
        convs = [p for n, p in inner.audio_tower.named_parameters() if n.startswith("conv")]
        reached["audio input convolution"] = convs[0]
    if model.family.deepstack:
        for i, merger in enumerate(inner.visual.deepstack_merger_list):
            reached[f"DeepStack merger {i}"] = next(merger.parameters())
    for name, param in reached.items():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    model.zero_grad()


def test_placeholders_must_fit_the_media(policy):
    model, tok = policy
    prompts, media = _rows(model, tok)
    pad = model.special.image
    short = list(prompts[0])
    short.remove(pad)  # the image takes 6 placeholders; the prompt now holds 5
    with pytest.raises(ValueError, match=r"row 0: the prompt's image placeholder runs hold \[5\]"):
        model(torch.tensor([short]), media=[media[0]])
    with pytest.raises(ValueError, match="more image placeholders than image media"):
        model.processor.expand([pad, pad], [media[0][0]])
    # A placeholder the policy samples after its prompt is an ordinary token.
    sampled = torch.tensor([prompts[0] + [pad]])
    with torch.no_grad():
        embeds = model.embed(sampled, [media[0]])
    token = model.get_input_embeddings()(torch.tensor([pad]))[0]
    assert torch.equal(embeds[0, -1], token)


def test_a_saved_policy_loads_back(tmp_path):
    """A checkpoint or prepared policy directory loads through from_pretrained, as a released
    Qwen checkpoint does: the same weights, processor settings and placeholder tokens."""
    model, tok = tiny_qwen_policy("qwen2.5-omni")
    model.save_pretrained(str(tmp_path))
    tok.save_pretrained(str(tmp_path))
    loaded, loaded_tok = load_policy(str(tmp_path), video_fps=4.0)
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert loaded.family.kind == "qwen2.5-omni" and loaded.special == model.special
    prompts, media = _rows(model, tok)
    items = _media(loaded)
    assert items["audio"].runs == _media(model)["audio"].runs
    ids = torch.tensor([prompts[2]])  # the audio row
    with torch.no_grad():
        theirs = loaded(ids, media=[[items["audio"]]]).logits
        ours = model(ids, media=[media[2]]).logits
    assert torch.equal(theirs, ours)


def test_a_prompt_scores_as_the_transformers_forward_scores_it(policy):
    """One unpadded prompt with every medium the model reads: the adapter's logits equal the
    model's own forward given the processor-style inputs (embedding merge, get_rope_index and
    DeepStack done by transformers)."""
    model, tok = policy
    items = _media(model)
    row = list(items.values())
    text = tok("Which?", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([model.processor.media_prompt_ids(text, row)])
    kwargs = {}
    for item in row:
        for key, value in item.inputs.items():
            kwargs[key] = value
    types = (ids == model.special.image).int() + 2 * (ids == model.special.video).int()
    if model.family.rope == "token_types":
        kwargs["mm_token_type_ids"] = types
        if model.family.kind == "qwen2.5-vl":
            kwargs["second_per_grid_ts"] = torch.tensor([items["video"].seconds_per_grid])
    else:
        kwargs["video_second_per_grid"] = torch.tensor([items["video"].seconds_per_grid])
    with torch.no_grad():
        ours = model(ids, media=[row]).logits
        model.hf.model.rope_deltas = None
        theirs = model.hf(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits
    diff = (ours - theirs).abs().max().item()
    print(f"{model.family.kind}: adapter vs transformers forward max |dlogit| = {diff:.2e}")
    assert diff <= 1e-5
