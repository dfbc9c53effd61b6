"""LoRA on a policy (train.lora): low-rank adapters injected into the policy's own modules.

The adapters go into the HF model in place (peft's `inject_adapter_in_model`), so the policy
stays the same class (`get_decoder`, `get_output_embeddings` and the rest work unchanged) and
its base weights are frozen. Parameter names gain `.base_layer` for an adapted layer's frozen
weight and `.lora_A.default` / `.lora_B.default` for the adapter; trainer and engines inject
the same config, so both hold the same adapter names, and weight sync moves only those.

On disk (a checkpoint, a registered model) a LoRA policy is the standard base + adapter pair:
the base weights under their plain HF names in the directory, and the adapter in PEFT's format
in `adapter/` (`adapter_config.json`, `adapter_model.safetensors`), which
`peft.PeftModel.from_pretrained(base, f"{dir}/adapter")` loads as it is. Engines keep the
adapter unmerged: an update replaces adapter tensors only, with the same arithmetic as the
trainer's (a merged engine would need a pristine base copy to merge each version into).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from safetensors.torch import load_file, save_file

ADAPTER_DIR = "adapter"
"""Where a LoRA policy's adapter lives inside its directory (PEFT's format)."""
_ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
"""PEFT's key prefix for an adapter saved from a PeftModel (what PeftModel.from_pretrained
expects)."""


def has_adapter(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, ADAPTER_DIR, "adapter_config.json"))


def attach_lora(
    model: torch.nn.Module,
    rank: int,
    alpha: float,
    dropout: float,
    targets: str,
    seed: int = 0,
):
    """Inject LoRA adapters (B zero: the policy is unchanged until trained; A drawn from
    `seed` alone, so every process of a run starts from the same adapter) into `model`'s
    `targets` (comma-separated module names) in place; the base weights are frozen. ValueError
    naming the targets when none of them is a module of the policy."""
    from peft import LoraConfig, inject_adapter_in_model

    modules = [t.strip() for t in targets.split(",") if t.strip()]
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=modules, bias="none"
    )
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            inject_adapter_in_model(config, model)
    except ValueError as err:
        raise ValueError(
            f"train.lora.target_modules: {targets!r} names no module of "
            f"{type(model).__name__} ({err})"
        ) from err
    fused = sorted(getattr(model.peft_config["default"], "target_parameters", None) or ())
    if fused:
        # peft retargets MLP names at a MoE's fused expert tensors (3-D parameters), with
        # ranks other than the one asked for; SGLang loads no such adapter either.
        raise ValueError(
            f"train.lora.target_modules: {targets!r} reaches the fused expert parameters "
            f"{fused} of {type(model).__name__}, which LoRA here does not adapt; name the "
            "attention projections (q_proj,k_proj,v_proj,o_proj) and any dense layers only"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(_is_adapter(name))
    return adapters_in_float32(model)


def adapters_in_float32(model: torch.nn.Module):
    """Adapter weights in float32 whatever the base's dtype (peft computes each adapter in its
    weights' dtype): small, and an RL-sized update to them does not round away."""
    for name, param in model.named_parameters():
        if _is_adapter(name) and param.dtype != torch.float32:
            param.data = param.data.float()
    return model


def for_run(model: torch.nn.Module, lora, seed: int = 0) -> torch.nn.Module:
    """`model` with the run's adapters (`lora`: train.lora; `seed`: the run's) when LoRA is on
    and the policy has none yet (a checkpoint's policy brings its own)."""
    if lora.rank > 0 and not is_lora(model):
        attach_lora(model, lora.rank, lora.alpha, lora.dropout, lora.target_modules, seed)
    return model


def synced_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """What weight sync moves for this policy: the adapter of a LoRA policy, else every
    parameter."""
    if is_lora(model):
        return adapter_weights(model)
    return ((name, param.detach()) for name, param in model.named_parameters())


def is_lora(model: torch.nn.Module) -> bool:
    return any(_is_adapter(name) for name, _ in model.named_parameters())


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter's tensors by parameter name, in parameter order."""
    for name, param in model.named_parameters():
        if _is_adapter(name):
            yield name, param.detach()


def base_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's weights under plain HF names, without the adapter."""
    return split_state(model.state_dict())[0]


def split_state(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA policy's state dict as (base under plain HF names, adapter under parameter
    names)."""
    base, adapter = {}, {}
    for key, tensor in state.items():
        if _is_adapter(key):
            adapter[key] = tensor
        elif ".lora_" not in key:
            base[key.replace(".base_layer.", ".")] = tensor
    return base, adapter


def save_adapter(
    model: torch.nn.Module,
    directory: str,
    tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """The adapter in PEFT's format under `directory`/adapter: `model`'s, or `tensors` by
    parameter name (the gathered adapter of a sharded policy)."""
    out = os.path.join(directory, ADAPTER_DIR)
    os.makedirs(out, exist_ok=True)
    config = model.peft_config["default"]
    config.save_pretrained(out)
    named = tensors.items() if tensors is not None else adapter_weights(model)
    saved = {
        _PEFT_PREFIX + name.replace(".default.", "."): t.to("cpu").contiguous() for name, t in named
    }
    save_file(saved, os.path.join(out, _ADAPTER_WEIGHTS))


def load_adapter(model: torch.nn.Module, directory: str):
    """Inject the adapter saved under `directory`/adapter into `model` and load its weights;
    every adapter tensor must be there, and nothing else."""
    from peft import LoraConfig

    path = os.path.join(directory, ADAPTER_DIR)
    config = LoraConfig.from_pretrained(path)
    attach_lora(
        model,
        config.r,
        config.lora_alpha,
        config.lora_dropout,
        ",".join(sorted(config.target_modules)),
    )
    saved = load_file(os.path.join(path, _ADAPTER_WEIGHTS))
    ours = {
        _PEFT_PREFIX + name.replace(".default.", "."): param
        for name, param in model.named_parameters()
        if _is_adapter(name)
    }
    if saved.keys() != ours.keys():
        missing, unexpected = sorted(ours.keys() - saved), sorted(saved.keys() - ours)
        raise ValueError(
            f"{path}: the adapter does not fit the policy: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    with torch.no_grad():
        for key, param in ours.items():
            param.copy_(saved[key])
    return model


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """The base policy for the duration (the KL reference of a LoRA run: the starting policy,
    since a fresh adapter is zero), without a second copy of the model."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield model
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name
