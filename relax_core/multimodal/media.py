"""Reading the media a prompt refers to: images, audio clips and videos, by reference.

A row carries media as `{kind, uri, bytes}` (the queue's `media` column): small items inline in
`bytes`, the rest as a URI (a local path, relative to the dataset's folder, or any fsspec URL such
as s3://). Parts:
- `read_bytes`: the item's bytes, inline or fetched, refusing anything over `max_bytes` before it
  is read;
- `decode_image` (PNG, JPEG, ... through Pillow), `decode_audio` (WAV, FLAC, OGG through
  libsndfile, mixed to mono and resampled), `decode_video` (MP4 and other containers through
  PyAV/FFmpeg, or a folder of frame images), each checking its size limit (pixels, seconds,
  frames) from the header before decoding the payload;
- `MediaError`: every failure, naming the item, what is wrong and the limit; the caller
  quarantines the row with that reason and the run goes on.
"""

from __future__ import annotations

import io
import math
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("image", "audio", "video")
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


class MediaError(ValueError):
    """A media item that cannot be used: missing, unreadable, of an unknown kind or too large."""

    def __init__(self, item: Mapping[str, Any], reason: str) -> None:
        where = item.get("uri") or f"inline {item.get('kind', 'media')} bytes"
        super().__init__(f"{item.get('kind', 'media')} {where}: {reason}")
        self.reason = reason


@dataclass(frozen=True)
class MediaLimits:
    """What a run accepts; anything larger is refused before it is decoded."""

    max_bytes: int = 64 << 20
    max_pixels: int = 4096 * 4096
    max_audio_seconds: float = 60.0
    max_video_seconds: float = 60.0
    max_frames: int = 64


def media_limits(data_cfg: Any) -> MediaLimits:
    """The limits a run's DataConfig (config/sections.py) sets."""
    d = data_cfg
    return MediaLimits(
        max_bytes=d.max_media_bytes,
        max_pixels=d.max_image_pixels,
        max_audio_seconds=d.max_audio_seconds,
        max_video_seconds=d.max_video_seconds,
        max_frames=d.max_video_frames,
    )


def check_item(item: Any) -> Mapping[str, Any]:
    if not isinstance(item, Mapping) or item.get("kind") not in KINDS:
        kind = item.get("kind") if isinstance(item, Mapping) else type(item).__name__
        raise MediaError(
            item if isinstance(item, Mapping) else {}, f"kind {kind!r} is not one of {KINDS}"
        )
    if not item.get("uri") and not item.get("bytes"):
        raise MediaError(item, "has neither a uri nor inline bytes")
    return item


def resolve_uri(uri: str, base_dir: str = "") -> str:
    """A relative local path is relative to `base_dir` (the dataset's folder); URLs stay."""
    if "://" in uri or posixpath.isabs(uri) or not base_dir:
        return uri
    return posixpath.join(base_dir, uri)


def read_bytes(
    item: Mapping[str, Any],
    limits: MediaLimits,
    base_dir: str = "",
    storage_options: Mapping[str, Any] | None = None,
) -> bytes:
    """The item's bytes: inline, or read through fsspec after checking the object's size."""
    from relax_core.config.filesystems import url_to_fs

    check_item(item)
    if item.get("bytes"):
        data = bytes(item["bytes"])
        if len(data) > limits.max_bytes:
            raise MediaError(
                item, f"{len(data)} bytes inline, over the limit of {limits.max_bytes}"
            )
        return data
    uri = resolve_uri(str(item["uri"]), base_dir)
    try:
        fs, path = url_to_fs(uri, **dict(storage_options or {}))
        size = fs.size(path)
        if size is not None and size > limits.max_bytes:
            raise MediaError(item, f"{size} bytes, over the limit of {limits.max_bytes}")
        with fs.open(path, "rb") as f:
            return f.read()
    except MediaError:
        raise
    except FileNotFoundError:
        raise MediaError(item, f"not found ({uri})") from None
    except (OSError, ValueError) as err:
        raise MediaError(item, f"cannot be read ({type(err).__name__}: {err})") from None


def decode_image(data: bytes, limits: MediaLimits, item: Mapping[str, Any] | None = None):
    """RGB `PIL.Image`; the pixel count is checked from the header first."""
    from PIL import Image, UnidentifiedImageError

    item = item or {"kind": "image"}
    try:
        image = Image.open(io.BytesIO(data))
        width, height = image.size
        if width * height > limits.max_pixels:
            raise MediaError(
                item, f"{width}x{height} pixels, over the limit of {limits.max_pixels}"
            )
        image.load()
        return image.convert("RGB")
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise MediaError(item, f"unreadable image ({err})") from None


def decode_audio(
    data: bytes, limits: MediaLimits, sample_rate: int, item: Mapping[str, Any] | None = None
) -> np.ndarray:
    """Mono float32 samples at `sample_rate`, shape [n]; the duration is checked first."""
    import soundfile

    item = item or {"kind": "audio"}
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            _check_length(item, f.frames / f.samplerate, limits.max_audio_seconds)
            samples = f.read(dtype="float32", always_2d=True)
            source_rate = f.samplerate
    except MediaError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as err:
        raise MediaError(item, f"unreadable audio ({err})") from None
    if samples.size == 0:
        raise MediaError(item, "holds no audio samples")
    return resample(samples.mean(axis=1), source_rate, sample_rate)


def _check_length(item: Mapping[str, Any], seconds: float, limit: float) -> None:
    if seconds > limit:
        raise MediaError(item, f"{seconds:.1f} s long, over the limit of {limit} s")


def resample(samples: np.ndarray, source_rate: int, target_rate: int) -> np.ndarray:
    """Band-limited polyphase resampling (scipy), float32."""
    if source_rate == target_rate:
        return samples.astype(np.float32, copy=False)
    from scipy.signal import resample_poly

    g = math.gcd(int(source_rate), int(target_rate))
    out = resample_poly(samples, int(target_rate) // g, int(source_rate) // g)
    return out.astype(np.float32, copy=False)


def sample_times(duration_s: float, fps: float, max_frames: int) -> list[float]:
    """Timestamps of the frames to keep: every 1/fps seconds from the middle of the first
    interval, at most `max_frames`, spread over the whole clip when it is longer."""
    if duration_s <= 0 or fps <= 0:
        return [0.0]
    n = max(1, min(max_frames, int(duration_s * fps)))
    step = duration_s / n
    return [step * (i + 0.5) for i in range(n)]


def decode_video(
    data: bytes, limits: MediaLimits, fps: float, item: Mapping[str, Any] | None = None
) -> np.ndarray:
    """RGB frames sampled at `fps` (at most `limits.max_frames`), uint8 [T, H, W, 3]."""
    import av

    item = item or {"kind": "video"}
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise MediaError(item, "has no video stream")
            stream = container.streams.video[0]
            duration = _duration_s(container, stream)
            _check_length(item, duration, limits.max_video_seconds)
            if stream.width * stream.height > limits.max_pixels:
                raise MediaError(
                    item,
                    f"{stream.width}x{stream.height} pixels a frame, over the limit of "
                    f"{limits.max_pixels}",
                )
            wanted = sample_times(duration, fps, limits.max_frames)
            # Each wanted time takes the frame on screen then: the last one starting at or
            # before it (the last frame for times past the end of the stream).
            frames, i, shown = [], 0, None
            for frame in container.decode(stream):
                t = float(frame.time) if frame.time is not None else 0.0
                while i < len(wanted) and shown is not None and t > wanted[i] + 1e-6:
                    frames.append(shown)
                    i += 1
                if i == len(wanted):
                    break
                shown = frame.to_ndarray(format="rgb24")
            while i < len(wanted) and shown is not None:
                frames.append(shown)
                i += 1
    except MediaError:
        raise
    except (av.error.FFmpegError, OSError, ValueError) as err:
        raise MediaError(item, f"unreadable video ({err})") from None
    if not frames:
        raise MediaError(item, "holds no decodable frame")
    return np.stack(frames)


def _duration_s(container, stream) -> float:
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return container.duration / 1_000_000  # av.time_base
    if stream.frames and stream.average_rate:
        return stream.frames / float(stream.average_rate)
    return 0.0


def decode_frame_folder(
    folder: str,
    limits: MediaLimits,
    fps: float,
    source_fps: float,
    item: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> np.ndarray:
    """A video given as a folder of frame images (sorted by name, `source_fps` apart)."""
    from relax_core.config.filesystems import url_to_fs

    item = item or {"kind": "video", "uri": folder}
    fs, path = url_to_fs(folder, **dict(storage_options or {}))
    try:
        names = sorted(p for p in fs.ls(path, detail=False) if p.lower().endswith(_FRAME_SUFFIXES))
    except FileNotFoundError:
        raise MediaError(item, f"frame folder not found ({folder})") from None
    if not names:
        raise MediaError(item, f"frame folder holds no {'/'.join(_FRAME_SUFFIXES)} images")
    duration = len(names) / source_fps
    _check_length(item, duration, limits.max_video_seconds)
    picks = sorted(
        {
            min(len(names) - 1, int(t * source_fps))
            for t in sample_times(duration, fps, limits.max_frames)
        }
    )
    frames = []
    for index in picks:
        with fs.open(names[index], "rb") as f:
            frames.append(np.asarray(decode_image(f.read(), limits, item)))
    if len({frame.shape for frame in frames}) > 1:
        raise MediaError(item, "frames differ in size")
    return np.stack(frames)
