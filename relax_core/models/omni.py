"""A tiny omni policy for CPU: small image, audio and video encoders whose outputs take the place of
`<media>` placeholder tokens in a tiny causal LM's input embeddings.

Parts:
- `OmniSpec`: sizes (image side and patch, mel bins, audio and video token counts), and how many
  placeholders each kind of medium takes in a prompt (`tokens_for`);
- encoder inputs are `MediaInput`s (kind + tensor) made by multimodal/features.py's
  `media_input` from decoded media, sized by the spec;
- `TinyOmni`: the LM plus three encoders: image patches (an MLP, plus a position per patch,
  plus a convolution max-pooled over the whole image added to each, so what the image shows
  reaches every image token wherever it sits: patch tokens alone left colour and shape
  unlearned in 150 RL steps);
  audio log-mels standardized per clip (two strided convolutions, pooled to `audio_tokens`);
  video frames, one token each: the frame's image patches averaged (what it shows) plus a
  convolution over its change since the previous frame, max-pooled (what moved, and which way,
  wherever it is in the frame; flattening the patches instead drowned that signal and left
  video unlearnable in a short run). `forward(input_ids, ..., media=...)` embeds the ids,
  writes each row's encoded media over its placeholders in order, and runs the LM on those
  embeddings; without `media` it is the LM on ids (decode steps after a prefill), so an engine
  passes media once per prefill and a trainer once per sequence;
- `save_omni` / `load_omni`: the LM as a Hugging Face directory, the encoders as
  `omni.safetensors` and the spec as `omni.json` beside it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from relax_core.multimodal.features import MediaInput, media_input, patchify

MEDIA_TOKEN = "<media>"
ENCODERS_VERSION = 2
"""Bumped whenever the encoders' layers change, so a cached prepared policy of older encoders is
not taken for the current ones (models/policy.py keys the cache on it)."""
SPEC_FILE = "omni.json"
WEIGHTS_FILE = "omni.safetensors"


@dataclass(frozen=True)
class OmniSpec:
    image_size: int = 32
    patch: int = 8
    n_mels: int = 32
    audio_rate: int = 8000
    audio_tokens: int = 8
    video_frames: int = 8
    video_fps: float = 8.0

    @property
    def image_tokens(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def modalities(self) -> tuple[str, ...]:
        return ("image", "audio", "video")

    def media_input(self, kind: str, decoded: Any) -> MediaInput:
        """One decoded medium -> its encoder input (multimodal/inputs.MediaEncoding)."""
        return media_input(kind, decoded, self)

    def tokens_for(self, kind: str) -> int:
        """Placeholders one medium of `kind` takes in the prompt."""
        counts = {
            "image": self.image_tokens,
            "audio": self.audio_tokens,
            "video": self.video_frames,
        }
        if kind not in counts:
            raise ValueError(f"media kind {kind!r} is not one of {sorted(counts)}")
        return counts[kind]


class TinyOmni(nn.Module):
    """`lm` (a Hugging Face causal LM) with encoders projecting media into its hidden size."""

    def __init__(self, lm: nn.Module, spec: OmniSpec, media_token_id: int) -> None:
        super().__init__()
        self.lm, self.spec, self.media_token_id = lm, spec, media_token_id
        d = lm.config.hidden_size
        patch_dim = 3 * spec.patch * spec.patch
        self.image_in = nn.Sequential(nn.Linear(patch_dim, d), nn.GELU(), nn.Linear(d, d))
        self.image_pos = nn.Parameter(torch.zeros(spec.image_tokens, d))
        # What the image shows wherever it is: a convolution max-pooled over the image, added to
        # every patch token (colour and edge detectors fire at any position).
        self.glance_in = nn.Conv2d(3, d, kernel_size=5, padding=2)
        self.audio_in = nn.Sequential(
            nn.Conv1d(spec.n_mels, d, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv1d(d, d, 3, stride=2, padding=1),
        )
        self.audio_out = nn.Linear(d, d)
        # Motion: a convolution over the change since the previous frame, max-pooled over the
        # frame, so a direction detector fires wherever the thing that moves is.
        self.motion_in = nn.Conv2d(3, d, kernel_size=5, padding=2)
        self.video_pos = nn.Parameter(torch.zeros(spec.video_frames, d))
        self.video_out = nn.Linear(d, d)
        self.config = lm.config  # engines and backends read config.vocab_size, eos, ...

    # ---------------------------------------------------------------- encoders
    def encode(self, item: MediaInput) -> torch.Tensor:
        """[tokens_for(kind), hidden] embeddings of one medium."""
        x = item.tensor.to(self.image_pos.dtype)
        if item.kind == "image":
            glance = nn.functional.gelu(self.glance_in(x)).amax((1, 2))  # [d]
            return self.image_in(patchify(x, self.spec.patch)) + self.image_pos + glance
        if item.kind == "audio":
            # Per-clip standardized log-mels: the pattern over time counts, not the loudness.
            x = (x - x.mean()) / (x.std() + 1e-5)
            h = self.audio_in(x.unsqueeze(0))  # [1, d, T/4]
            pooled = nn.functional.adaptive_avg_pool1d(h, self.spec.audio_tokens)[0].T
            return self.audio_out(pooled)
        if item.kind == "video":  # one token per frame: what it shows, and what moved
            patches = torch.stack([patchify(frame, self.spec.patch) for frame in x])
            shown = (self.image_in(patches) + self.image_pos).mean(1)  # [F, d]
            change = torch.cat([torch.zeros_like(x[:1]), x[1:] - x[:-1]])  # [F, 3, S, S]
            moved = nn.functional.gelu(self.motion_in(change)).amax((2, 3))  # [F, d]
            per_frame = shown + moved
            return self.video_out(per_frame + self.video_pos)
        raise ValueError(f"media kind {item.kind!r} is not one of image, audio, video")

    def embed(self, input_ids: torch.Tensor, media: list[list[MediaInput]]) -> torch.Tensor:
        """Token embeddings [B, T, d] with each row's media written over its placeholders."""
        embeds = self.lm.get_input_embeddings()(input_ids)
        if len(media) != input_ids.shape[0]:
            raise ValueError(f"media for {len(media)} rows, input_ids has {input_ids.shape[0]}")
        rows, done = [], {}
        for row, items in enumerate(media):
            slots = (input_ids[row] == self.media_token_id).nonzero().flatten()
            # A group's samples share their prompt's media objects: each is encoded once.
            for item in items:
                if id(item) not in done:
                    done[id(item)] = self.encode(item)
            encoded = [done[id(item)] for item in items]
            need = sum(e.shape[0] for e in encoded)
            if need > len(slots):
                raise ValueError(
                    f"row {row}: {len(slots)} {MEDIA_TOKEN} placeholders for media that take "
                    f"{need} ({', '.join(i.kind for i in items) or 'none'}); build the prompt "
                    "with OmniSpec.tokens_for"
                )
            # The prompt's placeholders come first; a `<media>` the policy sampled in its
            # response is an ordinary token, as it is in the engine's decode steps.
            slots = slots[:need]
            if need:
                rows.append(embeds[row].index_put((slots,), torch.cat(encoded).to(embeds.dtype)))
            else:
                rows.append(embeds[row])
        return torch.stack(rows)

    @staticmethod
    def is_encoder_parameter(name: str) -> bool:
        """Whether parameter `name` belongs to a media encoder (everything outside the LM)."""
        return not name.startswith("lm.")

    def get_decoder(self) -> nn.Module:
        return self.lm.get_decoder()

    def get_output_embeddings(self) -> nn.Module:
        return self.lm.get_output_embeddings()

    def save_pretrained(
        self, directory: str, state_dict: dict[str, torch.Tensor] | None = None, **_: Any
    ) -> None:
        """Save like a Hugging Face model, so checkpoints and prepared policies treat it alike
        (`state_dict`: what to write instead of the model's own, e.g. a LoRA policy's base)."""
        save_omni(self, directory, state_dict)

    def forward(
        self,
        input_ids: torch.Tensor,
        media: list[list[MediaInput]] | None = None,
        **kwargs: Any,
    ):
        if media is None:
            return self.lm(input_ids=input_ids, **kwargs)
        return self.lm(inputs_embeds=self.embed(input_ids, media), **kwargs)


OMNI_FIELDS = (
    "image_size",
    "patch_size",
    "audio_rate",
    "n_mels",
    "audio_tokens",
    "video_frames",
    "video_fps",
)
"""The ModelConfig fields of a tiny-omni policy's encoders."""


def omni_spec(model_cfg: Any) -> OmniSpec:
    """The encoders' input spec from a ModelConfig (config/sections.py)."""
    m = model_cfg
    return OmniSpec(
        image_size=m.image_size,
        patch=m.patch_size,
        n_mels=m.n_mels,
        audio_rate=m.audio_rate,
        audio_tokens=m.audio_tokens,
        video_frames=m.video_frames,
        video_fps=m.video_fps,
    )


def media_placeholders(row: Mapping[str, Any], spec: OmniSpec, media_token_id: int) -> list[int]:
    """The placeholder ids a prompt row's media take, in order (before the prompt's text)."""
    kinds = [item["kind"] for item in row.get("media") or []]
    return [media_token_id] * sum(spec.tokens_for(k) for k in kinds)


def add_media_token(tokenizer) -> int:
    """Give `tokenizer` the `<media>` placeholder (a special token, never split); its id."""
    if MEDIA_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_special_tokens({"additional_special_tokens": [MEDIA_TOKEN]})
    return tokenizer.convert_tokens_to_ids(MEDIA_TOKEN)


def media_prompt_ids(
    tokenizer, text: str, kinds: list[str], spec: OmniSpec, media_token_id: int
) -> list[int]:
    """Placeholders for each medium, in order, then the text's tokens."""
    ids = [media_token_id] * sum(spec.tokens_for(k) for k in kinds)
    return ids + tokenizer(text, add_special_tokens=False)["input_ids"]


def save_omni(
    model: TinyOmni, directory: str, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """The LM as a Hugging Face model in `directory`, the encoders beside it; `state_dict`
    (the model's own by default) holds both, the LM's under `lm.`."""
    state = model.state_dict() if state_dict is None else state_dict
    if state_dict is None:
        model.lm.save_pretrained(directory)
    else:
        lm = {k.removeprefix("lm."): v for k, v in state.items() if k.startswith("lm.")}
        model.lm.save_pretrained(directory, state_dict=lm)
    encoders = {k: v.contiguous() for k, v in state.items() if not k.startswith("lm.")}
    save_file(encoders, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, SPEC_FILE), "w") as f:
        json.dump({**asdict(model.spec), "media_token_id": model.media_token_id}, f, indent=1)


def load_omni(directory: str, dtype: torch.dtype = torch.float32) -> TinyOmni:
    from transformers import AutoModelForCausalLM

    with open(os.path.join(directory, SPEC_FILE)) as f:
        data = json.load(f)
    token_id = int(data.pop("media_token_id"))
    lm = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model = TinyOmni(lm, OmniSpec(**data), token_id).to(dtype)
    missing, unexpected = model.load_state_dict(
        load_file(os.path.join(directory, WEIGHTS_FILE)), strict=False
    )
    missing = [k for k in missing if not k.startswith("lm.")]
    if missing or unexpected:
        raise ValueError(
            f"{directory}: {WEIGHTS_FILE} does not fit the omni encoders (missing {missing}, "
            f"unexpected {unexpected})"
        )
    return model
