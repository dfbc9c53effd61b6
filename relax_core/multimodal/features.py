"""Model inputs from decoded media: image pixels, audio log-mel features, video frames.

Pure functions over arrays and tensors (no I/O; media.py decodes):
- `image_pixels`: resize to a square side, scale to [0, 1], normalize per channel -> [3, S, S];
- `patchify`: [C, S, S] -> [(S/P)^2, C*P*P], the patch sequence a ViT-style encoder embeds;
- `mel_filterbank` (HTK mel scale, triangular filters) and `log_mel`: mono samples ->
  [n_mels, frames] log10 power, clamped 8 decades below the clip's peak as Whisper does;
- `video_pixels`: every sampled frame as `image_pixels` -> [T, 3, S, S];
- `media_input`: one decoded medium -> the `MediaInput` an omni policy's encoder takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)


def image_pixels(image, size: int) -> torch.Tensor:
    """A PIL image -> float32 [3, size, size], normalized with IMAGE_MEAN / IMAGE_STD."""
    from PIL import Image

    resized = image.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
    return _normalize(torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0))


def video_pixels(frames: np.ndarray, size: int) -> torch.Tensor:
    """uint8 [T, H, W, 3] frames -> float32 [T, 3, size, size]."""
    from PIL import Image

    return torch.stack([image_pixels(Image.fromarray(frame), size) for frame in frames])


def _normalize(hwc: torch.Tensor) -> torch.Tensor:
    mean = torch.tensor(IMAGE_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGE_STD).view(3, 1, 1)
    return (hwc.permute(2, 0, 1) - mean) / std


def patchify(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[C, S, S] -> [(S // patch) ** 2, C * patch * patch], row-major over the patch grid."""
    c, h, w = pixels.shape
    if h % patch or w % patch:
        raise ValueError(f"image side {h}x{w} is not a multiple of the patch size {patch}")
    grid = pixels.reshape(c, h // patch, patch, w // patch, patch)
    return grid.permute(1, 3, 0, 2, 4).reshape((h // patch) * (w // patch), c * patch * patch)


def hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    return 2595.0 * np.log10(1.0 + np.asarray(hz, dtype=np.float64) / 700.0)


def mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    return 700.0 * (10.0 ** (np.asarray(mel, dtype=np.float64) / 2595.0) - 1.0)


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """[n_mels, n_fft // 2 + 1] triangular filters, evenly spaced on the HTK mel scale from 0 Hz
    to Nyquist."""
    freqs = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(sample_rate / 2), n_mels + 2))
    lower, center, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs[None, :] - lower) / (center - lower)
    falling = (upper - freqs[None, :]) / (upper - center)
    return torch.from_numpy(np.clip(np.minimum(rising, falling), 0.0, None)).float()


def log_mel(
    samples: np.ndarray | torch.Tensor,
    sample_rate: int,
    n_mels: int = 80,
    n_fft: int = 400,
    hop: int = 160,
) -> torch.Tensor:
    """Mono samples [n] -> log10 mel power [n_mels, 1 + n // hop] (Hann window, centered)."""
    wave = torch.as_tensor(samples, dtype=torch.float32)
    if wave.ndim != 1:
        raise ValueError(f"log_mel takes mono samples [n], got shape {tuple(wave.shape)}")
    spec = torch.stft(
        wave, n_fft, hop, window=torch.hann_window(n_fft), center=True, return_complex=True
    )
    power = spec.abs() ** 2  # [n_fft // 2 + 1, frames]
    mel = mel_filterbank(sample_rate, n_fft, n_mels) @ power
    logged = torch.log10(mel.clamp(min=1e-10))
    return torch.maximum(logged, logged.max() - 8.0)


@dataclass
class MediaInput:
    """One medium ready for its encoder: image [3, S, S], audio [n_mels, T], video [F, 3, S, S]."""

    kind: str
    tensor: torch.Tensor


def media_input(kind: str, decoded: Any, spec: Any) -> MediaInput:
    """Decoded media (a PIL image, mono samples at spec.audio_rate, uint8 frames) -> MediaInput,
    sized by `spec` (image_size, audio_rate, n_mels, video_frames; models/omni.OmniSpec)."""
    if kind == "image":
        return MediaInput(kind, image_pixels(decoded, spec.image_size))
    if kind == "audio":
        n_fft = max(64, spec.audio_rate // 40)  # 25 ms windows, 10 ms hops
        return MediaInput(
            kind, log_mel(decoded, spec.audio_rate, spec.n_mels, n_fft, spec.audio_rate // 100)
        )
    if kind == "video":
        frames = video_pixels(decoded, spec.image_size)
        if len(frames) < spec.video_frames:  # short clips repeat their last frame
            pad = frames[-1:].expand(spec.video_frames - len(frames), -1, -1, -1)
            frames = torch.cat([frames, pad])
        return MediaInput(kind, frames[: spec.video_frames])
    raise ValueError(f"media kind {kind!r} is not one of image, audio, video")
