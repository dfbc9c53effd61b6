"""What SGLang 0.5.23's `load_weights` does with each weight name, for the stand-in server.

The trainer sends HF checkpoint names; SGLang's model classes load them into their own fused
parameters or drop them. The rules, per architecture the configs serve (facts read from the
pinned source, not its code):

- Qwen3 (srt/models/qwen3.py, Qwen3ForCausalLM.load_weights) and Qwen2 (srt/models/qwen2.py,
  Qwen2ForCausalLM._legacy_load_weights; the v2 loader is off by default): q_proj/k_proj/v_proj
  load into `qkv_proj` (shards q, k, v) and gate_proj/up_proj into `gate_up_proj` (shards 0, 1);
  names holding `rotary_emb.inv_freq`, `rotary_emb.cos_cached`/`sin_cached` or `projector` are
  skipped; a bias SGLang lacks is skipped; any other name SGLang has no parameter for is skipped
  with a log warning (`lm_head.weight` of a tied model: its lm_head is the embedding, so the
  name is not a parameter). A stacked name whose fused target is missing is a KeyError on
  Qwen3 (the update fails) and skipped on Qwen2.
- Qwen3-MoE (srt/models/qwen3_moe.py, Qwen3MoeForCausalLM.load_weights): the same stacking,
  except names under `mlp.experts`, which load only through `FusedMoE.make_expert_params_mapping`
  (layers/moe/fused_moe_triton/layer.py): `experts.{e}.gate_proj.` / `up_proj.` into
  `experts.w13_*` (shards w1, w3) and `experts.{e}.down_proj.` into `experts.w2_*` (w2), for
  e < num_experts. transformers 5's fused names (`mlp.experts.gate_up_proj`,
  `mlp.experts.down_proj`) match neither rule and are skipped silently: such an update
  "succeeds" and leaves the experts as they were. `mtp` names are skipped.

So "skipped" means the server answered success and ignored the tensor; the stand-in records it,
and the contract tests assert that every name the trainer sent was consumed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

STACKED = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)
SKIPPED_SUBSTRINGS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


@dataclass(frozen=True)
class Target:
    """Where SGLang loads a name: its own parameter, and the shard / expert of it."""

    param: str
    shard: Any = None
    expert: int | None = None


def sglang_params(config: Any) -> set[str]:
    """SGLang's parameter names for an HF config (Qwen2/Qwen3 dense, Qwen3-MoE)."""
    moe = bool(getattr(config, "num_experts", 0))
    qwen2 = config.model_type == "qwen2"
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        names |= {p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"}
        if qwen2:
            names.add(p + "self_attn.qkv_proj.bias")
        else:
            names |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
        if moe:
            names |= {p + "mlp.gate.weight", p + "mlp.experts.w13_weight"}
            names.add(p + "mlp.experts.w2_weight")
        else:
            names |= {p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"}
    return names


def load_target(config: Any, params: set[str], name: str) -> Target | None:
    """The parameter SGLang loads `name` into; None when it skips the name; KeyError where
    SGLang raises one (the update then fails: "Failed to update parameter online")."""
    if getattr(config, "num_experts", 0):
        return _qwen3_moe(config.num_experts, params, name)
    return _dense(config.model_type == "qwen2", params, name)


def _skipped(name: str) -> bool:
    return any(s in name for s in SKIPPED_SUBSTRINGS) or "projector" in name


def _dense(qwen2: bool, params: set[str], name: str) -> Target | None:
    if (
        not qwen2
        and not name.startswith("model.")
        and name.startswith(("layers.", "embed_tokens.", "norm."))
    ):
        name = "model." + name
    if _skipped(name):
        return None
    for param, weight, shard in STACKED:
        if weight not in name:
            continue
        fused = name.replace(weight, param)
        if fused.endswith(".bias") and fused not in params:
            return None
        if fused not in params:
            if qwen2:
                return None  # Qwen2 skips a stacked name it has no target for
            raise KeyError(fused)  # Qwen3 indexes params_dict directly
        return Target(fused, shard)
    return Target(name) if name in params else None


def _qwen3_moe(num_experts: int, params: set[str], name: str) -> Target | None:
    if "mtp" in name or "rotary_emb.inv_freq" in name:
        return None
    for param, weight, shard in STACKED:
        if weight not in name or "mlp.experts" in name:
            continue
        fused = name.replace(weight, param)
        if fused in params:
            return Target(fused, shard)
        name = fused  # SGLang goes on with the renamed name, which then matches nothing
    expert = _EXPERT.fullmatch(name)
    if expert and int(expert.group(2)) < num_experts:
        prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
        fused = f"{prefix}.{'w2' if proj == 'down_proj' else 'w13'}_weight"
        shard = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj]
        return Target(fused, shard, e) if fused in params else None
    return Target(name) if name in params else None


def hf_slot(hf_params: dict[str, Any], name: str) -> Any:
    """The stand-in's own (HF) tensor a consumed checkpoint name writes: the parameter of that
    name, or an expert's slice of transformers 5's fused expert tensors ([E, 2I, H] gate then
    up, [E, H, I] down)."""
    if name in hf_params:
        return hf_params[name]
    expert = _EXPERT.fullmatch(name)
    if expert is None:
        raise KeyError(name)
    prefix, e, proj = expert.group(1), int(expert.group(2)), expert.group(3)
    if proj == "down_proj":
        return hf_params[f"{prefix}.down_proj"][e]
    gate_up = hf_params[f"{prefix}.gate_up_proj"][e]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]
