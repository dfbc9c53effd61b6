"""From a row's `media` references to a multimodal policy's encoder inputs, for rollout and trainer.

Rows travel through the queue with media by reference (`{kind, uri, bytes}`); every role that
runs the policy rebuilds the inputs from those references with a `MediaResolver`:
read (media.read_bytes) -> decode with the run's limits (media.decode_*) -> encoder input
(`MediaEncoding.media_input`). The encoding is the one thing that differs between policies: the
tiny omni policy's `OmniSpec` (features.media_input) or a Qwen policy's `QwenMediaProcessor`
(multimodal/qwen/processing.py). Decoded inputs are kept in a small LRU cache keyed by the
reference, so a group's samples (and a prompt seen again) decode their media once.

`split_by_media` sorts prompt rows into usable ones and quarantined ones, each with the reason
a user reads in the quarantine record; a bad medium costs its row, never the run.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from relax_core.multimodal.media import (
    MediaError,
    MediaLimits,
    check_item,
    decode_audio,
    decode_frame_folder,
    decode_image,
    decode_video,
    read_bytes,
    resolve_uri,
)


class MediaEncoding(Protocol):
    """How a policy's encoders take decoded media (models/omni.OmniSpec,
    multimodal/qwen.QwenMediaProcessor)."""

    @property
    def modalities(self) -> tuple[str, ...]:
        """The media kinds the policy reads."""
        ...

    @property
    def audio_rate(self) -> int:
        """Sample rate (Hz) audio is decoded at."""
        ...

    @property
    def video_fps(self) -> float:
        """Rate videos are sampled at (frames per second)."""
        ...

    def media_input(self, kind: str, decoded: Any) -> Any:
        """One decoded medium (PIL image, mono samples, uint8 frames [T, H, W, 3]) -> the input
        the policy takes for it; ValueError for a medium it cannot take."""
        ...


class MediaResolver:
    """Encoder inputs of media references, decoded once per reference (LRU of `cache_size`)."""

    def __init__(
        self,
        encoding: MediaEncoding,
        limits: MediaLimits,
        base_dir: str = "",
        storage_options: Mapping[str, Any] | None = None,
        cache_size: int = 256,
    ) -> None:
        self.encoding, self.limits = encoding, limits
        self.base_dir, self.storage_options = base_dir, dict(storage_options or {})
        self.cache_size = cache_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.decoded = 0
        """Media decoded (cache misses), for tests and metrics."""

    def inputs(self, media: Sequence[Mapping[str, Any]] | None) -> list:
        """The encoder inputs of one row's media, in order; MediaError for a bad item."""
        return [self._input(item) for item in (media or [])]

    def _input(self, item: Mapping[str, Any]):
        check_item(item)
        key = _key(item)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        kind, enc = item["kind"], self.encoding
        if kind not in enc.modalities:
            raise MediaError(item, f"the policy reads {', '.join(enc.modalities)}, not {kind}")
        uri = str(item.get("uri") or "")
        if kind == "video" and uri.endswith("/") and not item.get("bytes"):
            decoded = decode_frame_folder(
                resolve_uri(uri, self.base_dir),
                self.limits,
                enc.video_fps,
                # The row schema carries no frame rate: a folder's frames are taken to be
                # video_fps apart, the same in every role that reads the row.
                source_fps=enc.video_fps,
                item=item,
                storage_options=self.storage_options,
            )
        else:
            data = read_bytes(item, self.limits, self.base_dir, self.storage_options)
            if kind == "image":
                decoded = decode_image(data, self.limits, item)
            elif kind == "audio":
                decoded = decode_audio(data, self.limits, enc.audio_rate, item)
            else:
                decoded = decode_video(data, self.limits, enc.video_fps, item)
        try:
            value = enc.media_input(kind, decoded)
        except MediaError:
            raise
        except ValueError as err:  # e.g. an image too small or too narrow for the patch grid
            raise MediaError(item, f"the policy cannot take it ({err})") from None
        self.decoded += 1
        self._cache[key] = value
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return value


def _key(item: Mapping[str, Any]) -> str:
    if item.get("bytes"):
        return f"{item['kind']}:sha256:{hashlib.sha256(bytes(item['bytes'])).hexdigest()}"
    return f"{item['kind']}:{item['uri']}"


def split_by_media(
    rows: Sequence[Mapping[str, Any]], resolver: MediaResolver
) -> tuple[list[tuple[Mapping[str, Any], list]], list[tuple[Mapping[str, Any], str]]]:
    """(rows with their encoder inputs, rows to quarantine with the reason)."""
    usable, quarantined = [], []
    for row in rows:
        try:
            usable.append((row, resolver.inputs(row.get("media"))))
        except MediaError as err:
            quarantined.append((row, str(err)))
    return usable, quarantined
