"""Reading media by reference and turning it into model inputs, on files made here: PNG and JPEG
(Pillow), WAV and FLAC (libsndfile), MP4 (FFmpeg through PyAV) and frame folders. What a user
notices: the right pixels, samples and frames come back; anything missing, corrupt or over a limit
is refused with a message naming the item and the reason."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soundfile
import torch
from PIL import Image

from relax_core.multimodal import (
    MediaError,
    MediaLimits,
    decode_audio,
    decode_frame_folder,
    decode_image,
    decode_video,
    read_bytes,
)
from relax_core.multimodal.features import (
    image_pixels,
    log_mel,
    mel_filterbank,
    mel_to_hz,
    patchify,
    video_pixels,
)
from relax_core.multimodal.media import sample_times

LIMITS = MediaLimits()


def _image_bytes(fmt: str, size=(24, 16), colour=(200, 30, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format=fmt)
    return buf.getvalue()


def _tone(freq: float, seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def _audio_bytes(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt)
    return buf.getvalue()


def _video_bytes(n_frames: int, fps: int = 10, size: int = 32) -> bytes:
    """Frame i is a flat grey of level 12 * i, so a decoded frame tells which one it is."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for i in range(n_frames):
            frame = np.full((size, size, 3), 12 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_images_decode_to_their_pixels(fmt):
    image = decode_image(_image_bytes(fmt), LIMITS)
    assert image.size == (24, 16) and image.mode == "RGB"
    r, g, b = np.asarray(image).reshape(-1, 3).mean(axis=0)
    assert abs(r - 200) < 3 and abs(g - 30) < 3 and abs(b - 60) < 3  # JPEG is lossy


def test_an_oversized_or_corrupt_image_is_refused_naming_the_item():
    item = {"kind": "image", "uri": "shapes/big.png"}
    with pytest.raises(
        MediaError, match=r"image shapes/big.png: 24x16 pixels, over the limit of 100"
    ):
        decode_image(_image_bytes("PNG"), MediaLimits(max_pixels=100), item)
    with pytest.raises(MediaError, match="unreadable image"):
        decode_image(_image_bytes("PNG")[:40], LIMITS, item)
    with pytest.raises(MediaError, match="unreadable image"):
        decode_image(b"not an image", LIMITS, item)


@pytest.mark.parametrize("fmt", ["WAV", "FLAC"])
def test_audio_is_mixed_to_mono_and_resampled_keeping_its_pitch(fmt):
    stereo = np.stack([_tone(440, 1.0, 44100), _tone(440, 1.0, 44100)], axis=1)
    samples = decode_audio(_audio_bytes(stereo, 44100, fmt), LIMITS, 16000)
    assert samples.dtype == np.float32 and abs(len(samples) - 16000) <= 1
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16000 / len(samples) - 440) < 2  # still A4


def test_long_or_corrupt_audio_is_refused():
    item = {"kind": "audio", "uri": "beeps/long.wav"}
    data = _audio_bytes(_tone(440, 3.0, 8000), 8000, "WAV")
    with pytest.raises(MediaError, match=r"beeps/long.wav: 3.0 s long, over the limit of 2.0 s"):
        decode_audio(data, MediaLimits(max_audio_seconds=2.0), 16000, item)
    with pytest.raises(MediaError, match="unreadable audio"):
        decode_audio(b"RIFF\x00\x00garbage", LIMITS, 16000, item)


def test_video_frames_are_sampled_at_the_asked_rate():
    data = _video_bytes(n_frames=20, fps=10)  # 2 s
    frames = decode_video(data, LIMITS, fps=2.0)
    # 2 frames a second over 2 s: t = 0.25, 0.75, 1.25, 1.75 show source frames 2, 7, 12, 17
    # (frame k is on screen from k / 10 s)
    assert frames.shape == (4, 32, 32, 3) and frames.dtype == np.uint8
    levels = [int(round(f.mean() / 12)) for f in frames]
    assert levels == [2, 7, 12, 17]
    capped = decode_video(data, MediaLimits(max_frames=2), fps=10.0)
    assert [int(round(f.mean() / 12)) for f in capped] == [5, 15]  # spread over the whole clip
    every = decode_video(data, LIMITS, fps=10.0)  # the source rate: every frame once
    assert [int(round(f.mean() / 12)) for f in every] == list(range(20))


def test_long_or_corrupt_video_is_refused():
    item = {"kind": "video", "uri": "motion/clip.mp4"}
    with pytest.raises(MediaError, match=r"motion/clip.mp4: 2.0 s long, over the limit of 1.0 s"):
        decode_video(_video_bytes(20, 10), MediaLimits(max_video_seconds=1.0), 2.0, item)
    with pytest.raises(MediaError, match="unreadable video"):
        decode_video(b"\x00\x00\x00\x18ftypmp42 broken", LIMITS, 2.0, item)


def test_frame_folders_are_videos_too(tmp_path):
    for i in range(6):
        Image.new("RGB", (8, 8), (20 * i,) * 3).save(tmp_path / f"frame_{i:03d}.png")
    (tmp_path / "notes.txt").write_text("not a frame")
    frames = decode_frame_folder(str(tmp_path), LIMITS, fps=1.0, source_fps=2.0)
    # 3 s at 1 frame a second: t = 0.5, 1.5, 2.5 -> frames 1, 3, 5
    assert [int(f.mean() / 20) for f in frames] == [1, 3, 5]
    with pytest.raises(MediaError, match="frame folder not found"):
        decode_frame_folder(str(tmp_path / "none"), LIMITS, 1.0, 2.0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(MediaError, match="frame folder holds no .png"):
        decode_frame_folder(str(tmp_path / "empty"), LIMITS, 1.0, 2.0)


def test_read_bytes_inline_local_relative_and_missing(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_image_bytes("PNG"))
    ref = {"kind": "image", "uri": "img/a.png"}
    assert read_bytes(ref, LIMITS, base_dir=str(tmp_path)) == _image_bytes("PNG")
    assert read_bytes({"kind": "image", "bytes": b"abc"}, LIMITS) == b"abc"
    with pytest.raises(MediaError, match=r"image img/b.png: not found"):
        read_bytes({"kind": "image", "uri": "img/b.png"}, LIMITS, base_dir=str(tmp_path))
    with pytest.raises(MediaError, match="over the limit of 10"):
        read_bytes(ref, MediaLimits(max_bytes=10), base_dir=str(tmp_path))
    with pytest.raises(MediaError, match=r"kind 'text' is not one of"):
        read_bytes({"kind": "text", "uri": "x"}, LIMITS)
    with pytest.raises(MediaError, match="neither a uri nor inline bytes"):
        read_bytes({"kind": "audio"}, LIMITS)


def test_sample_times_cover_the_clip():
    assert sample_times(2.0, 2.0, 64) == [0.25, 0.75, 1.25, 1.75]
    assert sample_times(10.0, 30.0, 4) == [1.25, 3.75, 6.25, 8.75]
    assert sample_times(0.0, 2.0, 8) == [0.0]


# ---------------------------------------------------------------------------- features
def test_image_pixels_and_patches():
    image = Image.new("RGB", (40, 20), (255, 0, 128))
    pixels = image_pixels(image, 16)
    assert pixels.shape == (3, 16, 16)
    # (255/255 - 0.5) / 0.5 = 1; (0 - 0.5) / 0.5 = -1; (128/255 - 0.5) / 0.5 = 0.0039
    torch.testing.assert_close(
        pixels[:, 5, 5], torch.tensor([1.0, -1.0, 0.0039]), atol=1e-3, rtol=0
    )
    grid = torch.arange(2 * 4 * 4, dtype=torch.float32).reshape(2, 4, 4)
    patches = patchify(grid, 2)
    assert patches.shape == (4, 8)
    # patch (0, 1): channel 0 rows 0-1 cols 2-3 = 2, 3, 6, 7; channel 1 = those + 16
    assert patches[1].tolist() == [2, 3, 6, 7, 18, 19, 22, 23]
    with pytest.raises(ValueError, match="not a multiple of the patch size 3"):
        patchify(grid, 3)
    frames = np.zeros((3, 10, 12, 3), dtype=np.uint8)
    assert video_pixels(frames, 8).shape == (3, 3, 8, 8)


def test_mel_filters_tile_the_spectrum_and_a_tone_lights_its_band():
    bank = mel_filterbank(16000, 400, 40)
    assert bank.shape == (40, 201) and (bank >= 0).all()
    # Adjacent triangles cross at 0.5 and sum to 1 between the first and last centre.
    centres = mel_to_hz(np.linspace(0, 2595 * np.log10(1 + 8000 / 700), 42))[1:-1]
    freqs = np.linspace(0, 8000, 201)
    inside = (freqs > centres[0]) & (freqs < centres[-1])
    torch.testing.assert_close(
        bank.sum(0)[inside], torch.ones(int(inside.sum())), atol=1e-5, rtol=0
    )
    features = log_mel(_tone(1000, 1.0, 16000), 16000, n_mels=40)
    assert features.shape == (40, 101)
    band = int(features.mean(dim=1).argmax())
    assert centres[band - 1] < 1000 < centres[band + 1]  # the band around 1 kHz is brightest
    assert features.max() - features.min() <= 8.0 + 1e-6
