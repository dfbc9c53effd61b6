"""A tiny Qwen3-architecture policy and a character tokenizer, both built in code (no download).

The tokenizer is a real `transformers` fast tokenizer (WordLevel over single characters), so the
tiny policy saves and loads like any Hugging Face model directory and every engine/backend path that
serves a pretrained model serves this one unchanged.
"""

from __future__ import annotations

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from relax_core.config import ModelConfig
from relax_core.config.checks import TINY_POSITIONS

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
# Digits, arithmetic, the 'Answer:' convention and plain English letters cover the shipped tasks.
CHARSET = "0123456789+-*/=()., :?\n" + "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def build_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """One token per character; unknown characters map to <pad>'s neighbour '<unk>'."""
    specials = [PAD, BOS, EOS, "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(charset)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token="<unk>",
        padding_side="left",
    )


def build_tiny_qwen3(
    cfg: ModelConfig, vocab_size: int, seed: int
) -> Qwen3ForCausalLM | Qwen3MoeForCausalLM:
    """Randomly initialised Qwen3 decoder sized by `cfg` (deterministic for a seed); a Qwen3-MoE
    decoder when `cfg.num_experts` > 0, every layer sparse, each expert
    intermediate_size / experts_per_token wide (the active MLP width of the dense model)."""
    shape = {
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "max_position_embeddings": TINY_POSITIONS,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    if cfg.num_experts > 0:
        config = Qwen3MoeConfig(
            **shape,
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.experts_per_token,
            moe_intermediate_size=max(1, cfg.intermediate_size // cfg.experts_per_token),
            norm_topk_prob=True,  # as the released Qwen3-MoE checkpoints
        )
        model_class = Qwen3MoeForCausalLM
    else:
        config, model_class = Qwen3Config(**shape), Qwen3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config)
    return model.to(getattr(torch, cfg.dtype))
