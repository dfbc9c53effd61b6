"""Media in the roles: the prompt rows a run can use, and encoder inputs rebuilt from rows.

- `prompt_source(cfg, split, model, tokenizer, queue)`: the PromptSource of the train or eval
  split. For a multimodal policy (the tiny omni policy, models/omni.py; a Qwen VL or Omni
  policy, multimodal/qwen) its prompts hold the media's placeholder tokens (`placeholders_for`)
  and its items carry the encoder inputs. A row whose media is missing, unreadable or over the
  limits is quarantined with its reason and left out of the stream. Every rollout worker (and
  a restarted one) must number the same prompts alike, so the first to look records the
  verdict at `quarantine/prompts/{split}.json` and the others read it: a read that fails in one
  worker only (a flaky network) cannot shift another's prompt stream.
- `resolver_for(cfg, model)`: the MediaResolver that rebuilds the encoder inputs of queue rows
  (their `media` column holds references) for the trainer, reference and actor_fwd; None for a
  text policy. With `placeholders_for` (how prompts and env observations show media), the one
  place that tells the policies apart: the omni policy's encoders take their OmniSpec's inputs
  and `<media>` runs, a Qwen policy's its processor's inputs (videos at model.video_fps) and
  wrapped placeholder runs.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from relax_core.config import RunConfig
from relax_core.data.prompts import PromptSource
from relax_core.models.omni import TinyOmni
from relax_core.multimodal.inputs import MediaResolver, split_by_media
from relax_core.multimodal.media import media_limits
from relax_core.multimodal.placeholders import (
    MediaPlaceholders,
    OmniPlaceholders,
    QwenPlaceholders,
)
from relax_core.multimodal.qwen.policy import QwenPolicy

log = logging.getLogger(__name__)

QUARANTINE = "quarantine/prompts"


def resolver_for(cfg: RunConfig, model: Any) -> MediaResolver | None:
    """The MediaResolver of `model`'s encoders under the run's data limits; None for text."""
    if isinstance(model, TinyOmni):
        encoding = model.spec
    elif isinstance(model, QwenPolicy):
        encoding = model.processor.at_video_fps(cfg.model.video_fps)
    else:
        return None
    return MediaResolver(encoding, media_limits(cfg.data))


def placeholders_for(cfg: RunConfig, model: Any) -> MediaPlaceholders | None:
    """How `model` takes media in its prompts and env observations; None for a text policy."""
    resolver = resolver_for(cfg, model)
    if resolver is None:
        return None
    if isinstance(model, TinyOmni):
        return OmniPlaceholders(resolver, model.spec, model.media_token_id)
    return QwenPlaceholders(resolver)


def prompt_source(cfg: RunConfig, split: str, model: Any, tokenizer: Any, queue=None):
    from relax_core.data.dataset import load_prompts

    d = cfg.data
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rows = load_prompts(d.train_path if split == "train" else d.eval_path)
    media = placeholders_for(cfg, model)
    if media is not None:
        rows = usable_rows(rows, media.resolver, split, queue)
    elif any(row.get("media") for row in rows):
        raise ValueError(
            f"data.{split}_path has rows with media, but model.kind {cfg.model.kind!r} takes text "
            "only; use a multimodal model.kind (tiny-omni, qwen2.5-vl, qwen3-vl, qwen2.5-omni, "
            "qwen3-omni)"
        )
    shuffle = d.shuffle if split == "train" else False
    return PromptSource(
        rows, tokenizer, d.template, d.system_prompt, cfg.seed, shuffle, media=media
    )


def usable_rows(rows: list[dict], resolver: MediaResolver, split: str, queue=None) -> list[dict]:
    """`rows` without those whose media fails, as recorded for this run (or decided now)."""
    path = f"{QUARANTINE}/{split}.json"
    record = _read(queue, path)
    if record is None:
        _, bad = split_by_media(rows, resolver)
        index = {id(row): i for i, row in enumerate(rows)}
        record = {
            "split": split,
            "rows": len(rows),
            "quarantined": [
                {"index": index[id(row)], "media": row.get("media"), "reason": reason}
                for row, reason in bad
            ],
        }
        if queue is not None and not queue.store.create_if_absent(
            path, json.dumps(record).encode()
        ):
            record = _read(queue, path)  # another worker decided first: its verdict holds
        for item in record["quarantined"]:
            log.error("%s prompt %d quarantined: %s", split, item["index"], item["reason"])
    if record["rows"] != len(rows):
        raise ValueError(
            f"{path} was recorded for {record['rows']} {split} rows, the dataset has {len(rows)}: "
            "the dataset changed under a running run"
        )
    dropped = {item["index"] for item in record["quarantined"]}
    if len(dropped) == len(rows):
        raise ValueError(
            f"every {split} row's media failed (first: {record['quarantined'][0]['reason']})"
        )
    return [row for i, row in enumerate(rows) if i not in dropped]


def _read(queue, path: str) -> dict | None:
    if queue is None:
        return None
    try:
        return json.loads(queue.store.read_bytes(path))
    except FileNotFoundError:
        return None
