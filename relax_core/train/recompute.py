"""Activation checkpointing of an HF decoder (train.activation_checkpointing): the torch and
FSDP2 backends' recompute."""

from __future__ import annotations

from transformers import PreTrainedModel


def use_activation_checkpointing(model: PreTrainedModel) -> None:
    """Each decoder layer keeps only its input for backward and recomputes the rest there
    (transformers' gradient checkpointing). Non-reentrant: gradients reach a frozen LoRA base's
    inputs and FSDP2's hooks run as in a plain backward. transformers renamed the method after
    5.17 (the GPU image's), which has only the old name."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
