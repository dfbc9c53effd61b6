"""Images, audio and video: reading media by reference (media.py) and turning it into model
inputs (features.py).

May import: config.
"""

from relax_core.multimodal.media import (
    KINDS,
    MediaError,
    MediaLimits,
    decode_audio,
    decode_frame_folder,
    decode_image,
    decode_video,
    read_bytes,
)

__all__ = [
    "KINDS",
    "MediaError",
    "MediaLimits",
    "decode_audio",
    "decode_frame_folder",
    "decode_image",
    "decode_video",
    "read_bytes",
]
