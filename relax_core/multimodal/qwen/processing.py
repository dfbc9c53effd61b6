"""Decoded media -> a Qwen model's own inputs, and prompts with the right count of its placeholders.

`QwenMediaProcessor` does for one medium what the transformers processors (Qwen2_5_VLProcessor,
Qwen3VLProcessor, Qwen2_5OmniProcessor, Qwen3OmniMoeProcessor) do inside their `__call__`, but on
token ids, so it works with any tokenizer and with prompts rendered by our data templates:
- image (a PIL image) -> `pixel_values` [patches, C*tp*p*p] + `image_grid_thw` [1, 3], through
  the model's image processor (`Qwen2VLImageProcessorPil`, built from the checkpoint's
  preprocessor_config.json or in code);
- video (uint8 frames [T, H, W, 3] sampled at `video_fps`) -> `pixel_values_videos` +
  `video_grid_thw` + the seconds one temporal patch spans. Each frame goes through the image
  processor and consecutive frames fill the temporal slots of a patch: the layout
  Qwen2VLVideoProcessor produces, without the torchvision it needs (frames are sized by the
  image processor's pixel bounds, not the video processor's per-video budget);
- audio (mono samples at the feature extractor's rate) -> `input_features` [1, mels, frames] +
  `feature_attention_mask`, through the checkpoint's WhisperFeatureExtractor.

`placeholder_runs(item)` is how many placeholder tokens the medium takes (one run; a Qwen3-VL
video one run per temporal patch, each after its '<t seconds>' text), and `expand` replaces each
single placeholder of a prompt (one per medium, as a chat template writes it) by those runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relax_core.multimodal.qwen.families import Family

VISION_START = ("<|vision_start|>", "<|vision_bos|>")
VISION_END = ("<|vision_end|>", "<|vision_eos|>")
AUDIO_START = ("<|audio_start|>", "<|audio_bos|>")
AUDIO_END = ("<|audio_end|>", "<|audio_eos|>")


@dataclass(frozen=True)
class SpecialTokens:
    """The model's placeholder and wrapper token ids (from its config, else its tokenizer)."""

    image: int
    video: int
    audio: int | None
    vision_start: int
    vision_end: int
    audio_start: int | None
    audio_end: int | None

    def placeholder(self, kind: str) -> int:
        token = {"image": self.image, "video": self.video, "audio": self.audio}[kind]
        if token is None:
            raise ValueError(f"this model has no {kind} placeholder token")
        return token

    def wrappers(self, kind: str) -> tuple[int, int]:
        if kind == "audio":
            if self.audio_start is None or self.audio_end is None:
                raise ValueError("this model has no audio start/end tokens")
            return self.audio_start, self.audio_end
        return self.vision_start, self.vision_end

    @classmethod
    def of(cls, config: Any, tokenizer: Any = None) -> SpecialTokens:
        def pick(attr: str, names: tuple[str, ...] = ()) -> int | None:
            value = getattr(config, attr, None)
            if value is None and tokenizer is not None:
                vocab = tokenizer.get_vocab()
                value = next((vocab[n] for n in names if n in vocab), None)
            return value

        found = {
            "image": pick("image_token_id"),
            "video": pick("video_token_id"),
            "audio": pick("audio_token_id"),
            "vision_start": pick("vision_start_token_id", VISION_START),
            "vision_end": pick("vision_end_token_id", VISION_END),
            "audio_start": pick("audio_start_token_id", AUDIO_START),
            "audio_end": pick("audio_end_token_id", AUDIO_END),
        }
        missing = [k for k in ("image", "video", "vision_start", "vision_end") if found[k] is None]
        if missing:
            raise ValueError(f"model config and tokenizer name no token id for {missing}")
        return cls(**found)


@dataclass(eq=False)
class QwenMedia:
    """One medium as its Qwen model reads it. `inputs` holds the processor outputs for one item
    (pixel_values + image_grid_thw; pixel_values_videos + video_grid_thw; input_features +
    feature_attention_mask); `runs` the placeholder count of each run it fills, in order;
    `timestamps` the start text of each run (Qwen3-VL videos), else empty."""

    kind: str
    inputs: dict[str, torch.Tensor]
    runs: list[int]
    seconds_per_grid: float = 0.0
    """Video: seconds one temporal patch spans (temporal_patch_size / video_fps)."""
    timestamps: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(self.runs)


class QwenMediaProcessor:
    """Decoded media -> `QwenMedia`, and placeholder expansion, for one model (see module doc)."""

    def __init__(
        self,
        family: Family,
        special: SpecialTokens,
        image_processor: Any,
        feature_extractor: Any = None,
        tokenizer: Any = None,
        video_fps: float = 2.0,
        audio_window: int = 50,
    ) -> None:
        self.family, self.special = family, special
        self.image_processor, self.feature_extractor = image_processor, feature_extractor
        self.tokenizer, self.video_fps, self.audio_window = tokenizer, video_fps, audio_window
        self.merge = int(image_processor.merge_size)
        self.temporal_patch = int(image_processor.temporal_patch_size)
        if family.frame_timestamps and tokenizer is None:
            raise ValueError(f"{family.kind} videos need the tokenizer to write frame timestamps")

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media kinds the model reads."""
        return self.family.modalities

    @property
    def audio_rate(self) -> int:
        """Sample rate (Hz) audio must be decoded at."""
        if self.feature_extractor is None:
            raise ValueError(f"{self.family.kind} takes no audio")
        return int(self.feature_extractor.sampling_rate)

    def at_video_fps(self, video_fps: float) -> QwenMediaProcessor:
        """This processor for videos sampled at `video_fps` (a run's model.video_fps)."""
        if video_fps == self.video_fps:
            return self
        return QwenMediaProcessor(
            self.family,
            self.special,
            self.image_processor,
            self.feature_extractor,
            self.tokenizer,
            video_fps,
            self.audio_window,
        )

    # ------------------------------------------------------------------ media
    def media_input(self, kind: str, decoded: Any) -> QwenMedia:
        if kind not in self.family.modalities:
            raise ValueError(
                f"{self.family.kind} reads {', '.join(self.family.modalities)}, not {kind!r}"
            )
        if kind == "image":
            out = self.image_processor(images=[decoded], return_tensors="pt")
            inputs = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
            return QwenMedia(kind, inputs, [self._vision_tokens(inputs["image_grid_thw"][0])])
        if kind == "video":
            return self._video(np.asarray(decoded))
        if kind == "audio":
            return self._audio(np.asarray(decoded, dtype=np.float32))
        raise ValueError(f"media kind {kind!r} is not one of image, audio, video")

    def _vision_tokens(self, grid: torch.Tensor) -> int:
        return int(grid.prod()) // self.merge**2

    def _video(self, frames: np.ndarray) -> QwenMedia:
        from PIL import Image

        if frames.ndim != 4 or frames.shape[-1] != 3 or len(frames) == 0:
            raise ValueError(f"video frames must be uint8 [T, H, W, 3], got {frames.shape}")
        tp = self.temporal_patch
        count = len(frames)
        if count % tp:  # the processors repeat the last frame to fill the last temporal patch
            frames = np.concatenate([frames, np.repeat(frames[-1:], tp - count % tp, axis=0)])
        per_frame = [
            self.image_processor(images=[Image.fromarray(f)], return_tensors="pt") for f in frames
        ]
        grid = per_frame[0]["image_grid_thw"][0]
        n, dim = per_frame[0]["pixel_values"].shape
        # A patch is laid out [C, tp, p, p] and an image's holds tp copies of it: take one
        # copy from each of tp consecutive frames.
        slots = [p["pixel_values"].view(n, 3, tp, -1)[:, :, 0] for p in per_frame]
        groups = [torch.stack(slots[g : g + tp], dim=2) for g in range(0, len(slots), tp)]
        pixels = torch.cat([g.reshape(n, dim) for g in groups])
        t = len(groups)
        thw = torch.tensor([[t, int(grid[1]), int(grid[2])]])
        inputs = {"pixel_values_videos": pixels, "video_grid_thw": thw}
        per_patch = int(grid[1]) * int(grid[2]) // self.merge**2
        seconds = tp / self.video_fps
        if self.family.frame_timestamps:
            times = [i / self.video_fps for i in range(len(frames))]
            stamps = [(times[g] + times[g + tp - 1]) / 2 for g in range(0, len(times), tp)]
            return QwenMedia("video", inputs, [per_patch] * t, seconds, stamps)
        return QwenMedia("video", inputs, [per_patch * t], seconds)

    def _audio(self, samples: np.ndarray) -> QwenMedia:
        if self.feature_extractor is None or self.family.audio_tokens is None:
            raise ValueError(f"{self.family.kind} takes no audio")
        if samples.ndim != 1 or len(samples) == 0:
            raise ValueError(f"audio must be mono samples [n], got shape {samples.shape}")
        out = self.feature_extractor(
            samples,
            sampling_rate=self.audio_rate,
            return_attention_mask=True,
            padding="max_length",
            return_tensors="pt",
        )
        mask = out["attention_mask"]
        inputs = {"input_features": out["input_features"], "feature_attention_mask": mask}
        tokens = self.family.audio_tokens(int(mask.sum()), self.audio_window)
        return QwenMedia("audio", inputs, [tokens])

    # ------------------------------------------------------------------ prompts
    def expand(self, prompt_ids: list[int], media: list[QwenMedia]) -> list[int]:
        """`prompt_ids` with the i-th placeholder of each kind replaced by the runs of that kind's
        i-th medium (media in prompt order). Raises when placeholders and media do not pair up."""
        queues = {
            kind: [m for m in media if m.kind == kind] for kind in ("image", "video", "audio")
        }
        by_token = {self.special.placeholder(k): k for k in queues if k in self.family.modalities}
        out: list[int] = []
        for token in prompt_ids:
            kind = by_token.get(token)
            if kind is None:
                out.append(token)
                continue
            if not queues[kind]:
                raise ValueError(f"the prompt has more {kind} placeholders than {kind} media")
            out.extend(self._runs_ids(queues[kind].pop(0)))
        left = {k: len(q) for k, q in queues.items() if q}
        if left:
            raise ValueError(f"media without a placeholder in the prompt: {left}")
        return out

    def media_prompt_ids(self, text_ids: list[int], media: list[QwenMedia]) -> list[int]:
        """Each medium wrapped in its start/end tokens, in order, then the text (the layout a
        Qwen chat template gives a user turn that shows media before its question)."""
        ids: list[int] = []
        for item in media:
            start, end = self.special.wrappers(item.kind)
            ids += [start, self.special.placeholder(item.kind), end]
        return self.expand(ids, media) + list(text_ids)

    def _runs_ids(self, item: QwenMedia) -> list[int]:
        pad = self.special.placeholder(item.kind)
        if not item.timestamps:
            return [pad] * item.tokens
        # Qwen3VLProcessor.replace_video_token: '<t seconds>' + start + pads + end per patch.
        ids: list[int] = []
        for stamp, n in zip(item.timestamps, item.runs, strict=True):
            ids += self.tokenizer(f"<{stamp:.1f} seconds>", add_special_tokens=False)["input_ids"]
            ids += [self.special.vision_start, *[pad] * n, self.special.vision_end]
        return ids
