"""A Hugging Face Qwen multimodal model as a policy the torch engine and torch backend drive.

`QwenPolicy` wraps Qwen2_5_VLForConditionalGeneration, Qwen3VLForConditionalGeneration or an Omni
thinker (families.py) and speaks the interface of the tiny omni policy (models/omni.py): each
row's media (processing.QwenMedia, in prompt order) go with a prefill and with a whole-sequence
forward, never with decode steps. What a plain embedding swap cannot carry, `decoder_inputs` adds
(multimodal/protocol.MultimodalDecoder):
- M-RoPE position ids [3, B, T] from the model's own `get_rope_index`, computed per row over its
  real tokens up to the end of its last medium; the tokens after that (the prompt's question and
  the response) continue one past the last position. A function of the tokens alone, so a
  left-padded prefill + KV-cache decode (next position = last + 1) and a right-padded forward
  of prompt + response give every token the same position. (Inference servers such as SGLang
  and vLLM continue decoding from the largest position + 1 instead; the two agree unless a
  video's time positions run past the text after it.)
- DeepStack (Qwen3-VL, Qwen3-Omni): vision features of early encoder layers added to the first
  decoder layers' hidden states at the vision positions.

Each medium is encoded on its own, once per call (a group's samples share their prompt's media
objects), so the same medium gives bit-identical features in the engine and in the trainer
whatever it is batched with. Only the placeholders that the prompt's media fill are media: they
must come in runs of exactly the medium's token count, each closed by its end token; a
placeholder id the policy samples in its response stays an ordinary token.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from relax_core.multimodal.qwen.families import (
    Family,
    family_for_model_type,
    family_of_model,
    model_class,
)
from relax_core.multimodal.qwen.processing import QwenMedia, QwenMediaProcessor, SpecialTokens

KINDS = ("image", "video", "audio")


class QwenPolicy(nn.Module):
    """`hf` (a Qwen VL model or Omni thinker) + the processor that makes its media inputs."""

    def __init__(self, hf: nn.Module, processor: QwenMediaProcessor) -> None:
        super().__init__()
        self.hf, self.processor = hf, processor
        self.family: Family = family_of_model(hf)
        if processor.family != self.family:
            raise ValueError(f"{processor.family.kind} processor for a {self.family.kind} model")
        self.special = processor.special
        self.config = hf.config

    # ------------------------------------------------------------ the policy interface
    def get_decoder(self) -> nn.Module:
        return self.hf.model.language_model

    def get_input_embeddings(self) -> nn.Module:
        return self.hf.get_input_embeddings()

    def get_output_embeddings(self) -> nn.Module:
        return self.hf.lm_head

    def embed(self, input_ids: torch.Tensor, media: list[list[QwenMedia]]) -> torch.Tensor:
        """Token embeddings [B, T, d] with each row's media written over its placeholders."""
        mask = torch.ones_like(input_ids)
        return self.decoder_inputs(input_ids, mask, media)["inputs_embeds"]

    def forward(
        self,
        input_ids: torch.Tensor,
        media: list[list[QwenMedia]] | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if media is None:
            inputs = {"input_ids": input_ids, "position_ids": position_ids}
        else:
            mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
            inputs = self.decoder_inputs(input_ids, mask, media, position_ids)
        out = self.get_decoder()(attention_mask=attention_mask, **inputs, **kwargs)
        return CausalLMOutputWithPast(
            logits=self.hf.lm_head(out.last_hidden_state), past_key_values=out.past_key_values
        )

    def save_pretrained(self, directory: str, **kwargs: Any) -> None:
        """The model as its Hugging Face class saves it, plus the media processors' settings, so
        `load_qwen_policy(directory)` (and from_pretrained) reads it back."""
        self.hf.save_pretrained(directory, **kwargs)
        self.processor.image_processor.save_pretrained(directory)
        if self.processor.feature_extractor is not None:
            # Both write preprocessor_config.json; the Qwen checkpoints hold both in that file.
            path = os.path.join(directory, "preprocessor_config.json")
            with open(path) as f:
                merged = json.load(f)
            merged.update(self.processor.feature_extractor.to_dict())
            with open(path, "w") as f:
                json.dump(merged, f, indent=1)

    # ------------------------------------------------------------ decoder inputs
    def position_ids(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, media: list[list[QwenMedia]]
    ) -> torch.Tensor:
        """M-RoPE positions [3, B, T] of a padded batch (pads get 0)."""
        self._check_rows(input_ids, media)
        rows = [
            self._row_positions(input_ids[b], attention_mask[b], media[b], b)
            for b in range(input_ids.shape[0])
        ]
        dtype = torch.float if any(r.is_floating_point() for r in rows) else torch.long
        out = torch.zeros((3, *input_ids.shape), dtype=dtype, device=input_ids.device)
        for b, row in enumerate(rows):
            out[:, b, attention_mask[b].bool()] = row.to(dtype)
        return out

    def decoder_inputs(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        media: list[list[QwenMedia]],
        position_ids: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """Keyword inputs of `get_decoder()` for a batch with media: embeddings with the media
        written over their placeholders, M-RoPE positions, and DeepStack features."""
        self._check_rows(input_ids, media)
        if position_ids is None:
            position_ids = self.position_ids(input_ids, attention_mask, media)
        embeds = self.get_input_embeddings()(input_ids)
        encoded = self._encode(media)
        # Per kind, the media in the order of their placeholders in the flattened batch (rows in
        # order, a row's media in prompt order): the order masked_scatter fills a mask in.
        ordered: dict[str, list[QwenMedia]] = {kind: [] for kind in KINDS}
        masks: dict[str, torch.Tensor] = {}
        for b in range(input_ids.shape[0]):
            real = attention_mask[b].bool().nonzero().flatten()
            for item, idx in self._layout(input_ids[b, real], media[b], b):
                if item.kind not in masks:
                    masks[item.kind] = torch.zeros_like(input_ids, dtype=torch.bool)
                masks[item.kind][b, real[idx]] = True
                ordered[item.kind].append(item)
        for kind, mask in masks.items():
            values = torch.cat([encoded[id(item)][0] for item in ordered[kind]])
            embeds = embeds.masked_scatter(mask.unsqueeze(-1), values.to(embeds.dtype))
        inputs: dict[str, Any] = {"inputs_embeds": embeds, "position_ids": position_ids}
        if self.family.deepstack and ("image" in masks or "video" in masks):
            inputs.update(_deepstack(masks, ordered, encoded))
        return inputs

    def _check_rows(self, input_ids: torch.Tensor, media: list) -> None:
        if len(media) != input_ids.shape[0]:
            raise ValueError(f"media for {len(media)} rows, input_ids has {input_ids.shape[0]}")

    def _encode(self, media: list[list[QwenMedia]]) -> dict[int, tuple[torch.Tensor, list]]:
        """Each distinct medium's (features [tokens, d], DeepStack features per layer)."""
        inner, done = self.hf.model, {}
        for items in media:
            for item in items:
                if id(item) in done:
                    continue
                x = {k: v.to(self.hf.device) for k, v in item.inputs.items()}
                if item.kind == "audio":
                    out = inner.get_audio_features(
                        x["input_features"], x["feature_attention_mask"], return_dict=True
                    )
                    feats, deep = out.last_hidden_state, []
                else:
                    if item.kind == "image":
                        out = inner.get_image_features(
                            x["pixel_values"], x["image_grid_thw"], return_dict=True
                        )
                    else:
                        out = inner.get_video_features(
                            x["pixel_values_videos"], x["video_grid_thw"], return_dict=True
                        )
                    feats = out.pooler_output[0]
                    deep = [f[0] for f in getattr(out, "deepstack_features", None) or []]
                if feats.shape[0] != item.tokens:
                    raise ValueError(
                        f"the {item.kind} encoder made {feats.shape[0]} features for a medium "
                        f"processed to take {item.tokens} tokens: processor and model disagree"
                    )
                done[id(item)] = (feats, deep)
        return done

    # ------------------------------------------------------------ placeholder layout
    def _layout(
        self, ids: torch.Tensor, items: list[QwenMedia], row: int
    ) -> list[tuple[QwenMedia, torch.Tensor]]:
        """(medium, indices into the row's real tokens of its placeholders), in order; checks
        that the prompt's first placeholder runs of each kind are the media's runs, each
        followed by the kind's end token."""
        out = []
        for kind in KINDS:
            mine = [item for item in items if item.kind == kind]
            if not mine:
                continue
            token = self.special.placeholder(kind)
            end = self.special.wrappers(kind)[1]
            found = _runs(ids, token)
            need = [n for item in mine for n in item.runs]
            have = [stop - start for start, stop in found[: len(need)]]
            if have != need:
                raise ValueError(
                    f"row {row}: the prompt's {kind} placeholder runs hold {have} tokens, its "
                    f"{kind} media take {need}; build the prompt with "
                    "QwenMediaProcessor.expand (or media_prompt_ids)"
                )
            runs = iter(found)
            for item in mine:
                spans = [next(runs) for _ in item.runs]
                for _, stop in spans:
                    if stop >= len(ids) or int(ids[stop]) != end:
                        raise ValueError(
                            f"row {row}: a {kind} placeholder run at {stop} is not closed by "
                            f"its end token {end}"
                        )
                idx = [torch.arange(a, b, device=ids.device) for a, b in spans]
                out.append((item, torch.cat(idx)))
        return out

    def _row_positions(self, ids, mask, items: list[QwenMedia], row: int) -> torch.Tensor:
        """[3, n] positions of the row's n real tokens."""
        ids = ids[mask.bool()]
        if not items:
            return torch.arange(len(ids), device=ids.device).expand(3, -1)
        layout = self._layout(ids, items, row)
        prefix = max(int(idx.max()) for _, idx in layout) + 2  # through the closing token
        head = self._rope(ids[:prefix], layout)
        tail = torch.arange(1, len(ids) - prefix + 1, device=ids.device)
        return torch.cat([head, head[:, -1:] + tail.expand(3, -1)], dim=1)

    def _rope(self, ids: torch.Tensor, layout: list[tuple[QwenMedia, torch.Tensor]]):
        """The model's get_rope_index over one row's tokens up to its last medium: [3, n]."""
        inner = self.hf.model
        kinds = {k: [item for item, _ in layout if item.kind == k] for k in KINDS}
        image = _cat([item.inputs["image_grid_thw"] for item in kinds["image"]])
        video = _cat([item.inputs["video_grid_thw"] for item in kinds["video"]])
        seconds = torch.tensor([item.seconds_per_grid for item in kinds["video"]])
        if self.family.rope == "token_types":
            types = torch.zeros_like(ids, dtype=torch.int)
            for item, idx in layout:
                types[idx] = 1 if item.kind == "image" else 2
            extra = {"second_per_grid_ts": seconds} if self.family.kind == "qwen2.5-vl" else {}
            pos, _ = inner.get_rope_index(
                ids[None], types[None], image_grid_thw=image, video_grid_thw=video, **extra
            )
            return pos[:, 0]
        audio = [item.inputs["feature_attention_mask"].sum() for item in kinds["audio"]]
        pos, _ = inner.get_rope_index(
            ids[None],
            image,
            video,
            torch.ones_like(ids)[None],
            False,
            torch.stack(audio) if audio else None,
            seconds if kinds["video"] else None,
        )
        return pos[:, 0]


def _deepstack(masks: dict, ordered: dict, encoded: dict) -> dict[str, Any]:
    """visual_pos_masks [B, T] (image or video placeholders) and, per DeepStack layer, the
    features [n_visual, d] of those positions in row-major order."""
    visual = masks.get("image", torch.zeros_like(next(iter(masks.values()))))
    visual = visual | masks.get("video", torch.zeros_like(visual))
    layers = None
    for kind in ("image", "video"):
        if kind not in masks:
            continue
        per_layer = list(zip(*(encoded[id(item)][1] for item in ordered[kind]), strict=True))
        if layers is None:
            first = per_layer[0][0]
            layers = [first.new_zeros(int(visual.sum()), first.shape[-1]) for _ in per_layer]
        where = masks[kind][visual].nonzero().flatten()
        layers = [
            layer.index_put((where,), torch.cat(feats))
            for layer, feats in zip(layers, per_layer, strict=True)
        ]
    return {"visual_pos_masks": visual, "deepstack_visual_embeds": layers}


def _runs(ids: torch.Tensor, token: int) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive `token`s in `ids`."""
    hits = (ids == token).tolist() + [False]
    runs, start = [], None
    for i, hit in enumerate(hits):
        if hit and start is None:
            start = i
        elif not hit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    return torch.cat(tensors) if tensors else None


def load_qwen_policy(
    source: str, dtype: str = "float32", video_fps: float = 2.0
) -> tuple[QwenPolicy, Any]:
    """(policy, tokenizer) from a Hugging Face id or directory: a released checkpoint (for the
    Omni models, the thinker of the full model) or one `QwenPolicy.save_pretrained` wrote."""
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLImageProcessorPil

    config = AutoConfig.from_pretrained(source)
    family = family_for_model_type(config.model_type)
    if family is None:
        raise ValueError(
            f"{source}: model_type {config.model_type!r} is not a Qwen multimodal model "
            "(qwen2.5-vl, qwen3-vl, qwen2.5-omni, qwen3-omni)"
        )
    # A full Omni checkpoint holds thinker, talker and vocoder; the policy is its thinker
    # (transformers maps the checkpoint's thinker.* weights onto the thinker class).
    config = getattr(config, "thinker_config", None) or config
    hf = model_class(family).from_pretrained(source, config=config, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(source)
    feature_extractor, window = None, 50
    if "audio" in family.modalities:
        from transformers import WhisperFeatureExtractor

        feature_extractor = WhisperFeatureExtractor.from_pretrained(source)
        window = int(getattr(hf.config.audio_config, "n_window", window))
    processor = QwenMediaProcessor(
        family,
        SpecialTokens.of(hf.config, tokenizer),
        Qwen2VLImageProcessorPil.from_pretrained(source),
        feature_extractor,
        tokenizer,
        video_fps=video_fps,
        audio_window=window,
    )
    return QwenPolicy(hf, processor), tokenizer
