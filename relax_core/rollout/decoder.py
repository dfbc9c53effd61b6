"""A Llama-family decoder's generation forward on a CPU, without transformers' per-call work.

At the torch engine's sizes (the CPU default: 256 rows, 2 layers, a handful of tokens a step)
a decode step's matrix products are a third of its time; the rest is per-call work around
them: transformers builds a 4D mask from the 2D one at every call and goes through its cache
object and output-capturing wrappers layer by layer. `LeanDecoder`
runs the same modules (embeddings, norms, projections, rotary embedding, MLP, LM head, each
called as the model holds it, so bf16 linear layers (models/precision.py) and LoRA adapters
apply) with the key mask kept as one bool tensor. Its KV cache grows by concatenation as
transformers' does: a cache allocated for the longest answer and written in place made each
decode step's attention read strided keys and each decode-batch compaction copy the unused
columns too (the tiny task's generation 38 -> 44 ms).

Attention runs in float32, as `model.matmul_dtype` policies compute it (models/attention.py):
a decode step through `_decode_attention`, a prefill through `_attend` (SDPA with grouped
heads, or for short prompts its batched products) with a mask causal over each row's real keys
(a padding query sees itself, so that no row is all masked).
Equal to the transformers forward to float32 rounding (tests/unit/test_lean_decoder.py).

Which models: dense text decoders of the Llama family (model_type llama, mistral, qwen2, qwen3)
with the default rotary embedding, no sliding window; `lean_decoder(model)` returns None for
anything else and the engine keeps the transformers forward. The engine takes it on a CPU only
(rollout/torch_engine.py decides per call, where the model is then).
"""

from __future__ import annotations

import torch

from relax_core.models.attention import _attend, _decode_attention

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def lean_decoder(model: torch.nn.Module) -> LeanDecoder | None:
    """A LeanDecoder over `model` (a transformers causal LM, or a PEFT model around one) when it
    is a dense Llama-family decoder that this forward computes exactly, else None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    inner = getattr(base, "model", None)
    if (
        config is None
        or inner is None
        or getattr(config, "model_type", None) not in LEAN_MODEL_TYPES
    ):
        return None
    layers = getattr(inner, "layers", None)
    rotary = getattr(inner, "rotary_emb", None)
    if not layers or rotary is None or getattr(rotary, "rope_type", None) != "default":
        return None
    if getattr(config, "pretraining_tp", 1) != 1 or _sliding(config):
        return None
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or not all(
            hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")
        ):
            return None
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return None
    return LeanDecoder(base)


def _sliding(config) -> bool:
    """Whether any layer attends through a sliding window."""
    if getattr(config, "use_sliding_window", False):
        return True
    types = getattr(config, "layer_types", None) or ()
    if any(t != "full_attention" for t in types):
        return True
    return getattr(config, "model_type", "") == "mistral" and config.sliding_window is not None


class LeanDecoder:
    """Prefill and decode forwards of one generation batch and its KV cache."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.inner = model.model
        self.layers = list(self.inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.key_mask = torch.zeros(0, 0, dtype=torch.bool)
        """[B, columns] which cache columns hold a real token of each row."""
        self.length = 0
        """Columns written so far."""

    def start(self, rows: int, columns: int) -> None:
        """An empty cache for `rows` rows of up to `columns` tokens."""
        self.keys, self.values = [], []
        self.key_mask = torch.zeros(rows, columns, dtype=torch.bool)
        self.length = 0

    def select(self, rows: torch.Tensor) -> None:
        """Keep the cache rows `rows` (in that order; a row may repeat)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.key_mask = self.key_mask.index_select(0, rows)

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """The last position's logits [B, V] for `ids` [B, T] appended to the cache; `mask`
        [B, T] marks real tokens (left padding 0), `positions` [B, T] their rotary positions."""
        rows, width = ids.shape
        start, end = self.length, self.length + width
        if end > self.key_mask.shape[1]:
            raise ValueError(f"cache holds {self.key_mask.shape[1]} columns, {end} needed")
        self.key_mask[:, start:end] = mask.bool()
        keys_seen = self.key_mask[:, :end]
        if width == 1:
            attn_mask = keys_seen.view(rows, 1, 1, end)
        else:
            causal = torch.ones(width, end, dtype=torch.bool).tril(start)
            attn_mask = keys_seen[:, None, :] & causal
            attn_mask[:, :, start:end] |= torch.eye(width, dtype=torch.bool)
            attn_mask = attn_mask.unsqueeze(1)
        hidden = self.inner.embed_tokens(ids)
        cos, sin = self.inner.rotary_emb(hidden, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        for i, layer in enumerate(self.layers):
            hidden = hidden + self._attention(
                layer.self_attn, layer.input_layernorm(hidden), cos, sin, i, attn_mask, start
            )
            mlp = layer.mlp
            x = layer.post_attention_layernorm(hidden)
            hidden = hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))
        self.length = end
        return self.model.lm_head(self.inner.norm(hidden[:, -1]))

    def _attention(self, attn, x, cos, sin, layer, attn_mask, start) -> torch.Tensor:
        rows, width, _ = x.shape
        shape = (rows, width, -1, self.head_dim)
        q, k = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3 normalizes each head's queries and keys
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = attn.v_proj(x).view(shape).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if layer < len(self.keys):
            keys = self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            values = self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        else:
            keys, values = k, v
            self.keys.append(k)
            self.values.append(v)
        if width == 1:
            out = _decode_attention(q, keys, values, attn_mask, attn.scaling)
        else:
            out = _attend(q, keys, values, attn_mask, {"scaling": attn.scaling})
            out = out.transpose(1, 2).to(q.dtype)
        return attn.o_proj(out.reshape(rows, width, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
