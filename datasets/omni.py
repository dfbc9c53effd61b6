"""Omni-modal multiple-choice questions on media made here: the colour or shape of a drawn figure
(image), the number of beeps in a clip (audio), the way a dot moves in a short video (video).

Each row: "prompt" (the question and lettered choices), "answer" (the letter), "choices", "media"
([{"kind", "uri"}], the uri relative to the JSONL's folder) and "meta" ({"modality", "label"}).
Media files: media/{split}/{modality}-{index:05d}.png|.flac|.mp4 (32x32 PNG; 8 kHz mono FLAC,
1.6 s; 32x32 MP4, 8 frames at 8 fps). Every question's answer is fixed by its media alone: a test
recovers each label from the decoded file with plain signal processing. Deterministic: the same
seed writes the same rows and the same pixels, samples and frames.

    python datasets/omni.py --out datasets/omni [--per-modality 300] [--eval-per-modality 64]
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random

import numpy as np

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
DIRECTIONS = ("left", "right", "up", "down")
BEEPS = (1, 2, 3, 4)
SIZE = 32
BACKGROUND = (245, 245, 245)
AUDIO_RATE = 8000
AUDIO_SECONDS = 1.6
BEEP_SECONDS = 0.12
VIDEO_FRAMES = 8
VIDEO_FPS = 8
STEP_PX = 2
LETTERS = "ABCD"


def _question(text: str, choices: list[str], label: str) -> tuple[str, str]:
    lines = [text, *[f"{LETTERS[i]}. {c}" for i, c in enumerate(choices)], "Answer:"]
    return "\n".join(lines), LETTERS[choices.index(label)]


def draw_image(rng: random.Random, colour: str, shape: str) -> bytes:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    side = rng.randint(12, 20)
    x, y = rng.randint(2, SIZE - side - 2), rng.randint(2, SIZE - side - 2)
    box = (x, y, x + side - 1, y + side - 1)
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        draw.polygon(
            [(x, y + side - 1), (x + side - 1, y + side - 1), (x + side // 2, y)], fill=fill
        )
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def beep_clip(rng: random.Random, beeps: int) -> bytes:
    import soundfile

    n = int(AUDIO_SECONDS * AUDIO_RATE)
    clip = np.random.default_rng(rng.getrandbits(32)).normal(0.0, 0.01, n)
    slots = sorted(rng.sample(range(4), beeps))  # four 0.4 s slots, one beep at most in each
    for slot in slots:
        start = int((slot * 0.4 + rng.uniform(0.05, 0.2)) * AUDIO_RATE)
        t = np.arange(int(BEEP_SECONDS * AUDIO_RATE)) / AUDIO_RATE
        freq = rng.uniform(500, 1200)
        clip[start : start + len(t)] += 0.5 * np.sin(2 * math.pi * freq * t) * np.hanning(len(t))
    buf = io.BytesIO()
    soundfile.write(buf, clip.astype(np.float32), AUDIO_RATE, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


def moving_dot(rng: random.Random, direction: str) -> bytes:
    import av

    dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]
    travel = STEP_PX * (VIDEO_FRAMES - 1)
    lo, hi = 4, SIZE - 8
    x = rng.randint(lo + travel, hi) if dx < 0 else rng.randint(lo, hi - travel * abs(dx))
    y = rng.randint(lo + travel, hi) if dy < 0 else rng.randint(lo, hi - travel * abs(dy))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=VIDEO_FPS, options={"qscale": "2"})
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        for i in range(VIDEO_FRAMES):
            frame = np.full((SIZE, SIZE, 3), 235, dtype=np.uint8)
            cx, cy = x + dx * STEP_PX * i, y + dy * STEP_PX * i
            frame[cy : cy + 4, cx : cx + 4] = (20, 20, 20)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _row(rng: random.Random, modality: str, uri: str) -> tuple[dict, bytes]:
    if modality == "image" and rng.random() < 0.5:
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        choices = list(COLOURS)
        prompt, answer = _question("What colour is the shape in the image?", choices, colour)
        label, data = colour, draw_image(rng, colour, shape)
    elif modality == "image":
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        choices = list(SHAPES)
        prompt, answer = _question("Which shape is in the image?", choices, shape)
        label, data = shape, draw_image(rng, colour, shape)
    elif modality == "audio":
        beeps = rng.choice(BEEPS)
        choices = [str(b) for b in BEEPS]
        prompt, answer = _question("How many beeps are in the clip?", choices, str(beeps))
        label, data = str(beeps), beep_clip(rng, beeps)
    else:
        direction = rng.choice(DIRECTIONS)
        choices = list(DIRECTIONS)
        prompt, answer = _question("Which way does the dot move?", choices, direction)
        label, data = direction, moving_dot(rng, direction)
    row = {
        "prompt": prompt,
        "answer": answer,
        "choices": choices,
        "media": [{"kind": modality, "uri": uri}],
        "meta": {"modality": modality, "label": label},
    }
    return row, data


_SUFFIX = {"image": "png", "audio": "flac", "video": "mp4"}


def generate(out: str, seed: int = 0, per_modality: int = 300, eval_per_modality: int = 64):
    """Write media under `out`/media and return (train_rows, eval_rows)."""
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for split, count, offset in (("train", per_modality, 0), ("eval", eval_per_modality, 1)):
        for m, modality in enumerate(("image", "audio", "video")):
            rng = random.Random(seed * 1000 + offset * 100 + m)
            for i in range(count):
                uri = f"media/{split}/{modality}-{i:05d}.{_SUFFIX[modality]}"
                row, data = _row(rng, modality, uri)
                path = os.path.join(out, uri)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
                splits[split].append(row)
    return splits["train"], splits["eval"]


def main(argv: list[str] | None = None) -> None:
    from relax_core.data.dataset import write_prompts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for the JSONL files and media/")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-modality", type=int, default=300, help="train rows per modality")
    parser.add_argument("--eval-per-modality", type=int, default=64)
    args = parser.parse_args(argv)
    train, eval_ = generate(args.out, args.seed, args.per_modality, args.eval_per_modality)
    write_prompts(train, os.path.join(args.out, "train.jsonl"))
    write_prompts(eval_, os.path.join(args.out, "eval.jsonl"))
    print(f"wrote {len(train)} train and {len(eval_)} eval rows to {args.out}")


if __name__ == "__main__":
    main()
