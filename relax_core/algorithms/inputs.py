"""The typed input every policy loss takes: per-token log-probs, advantages and the loss mask."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

_REQUIRED = ("logprobs", "old_logprobs", "advantages", "loss_mask")
_OPTIONAL = ("ref_logprobs", "rollout_logprobs", "entropy")
# Inputs that come from other models or earlier passes; a graph attached to them would give the
# loss a gradient path the algorithms do not intend (e.g. the PPO ratio would become constant).
_NO_GRAD = ("old_logprobs", "ref_logprobs", "rollout_logprobs")


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors over response tokens, all float [B, T], right-padded.

    Padded positions are those where ``loss_mask`` is 0; their values are ignored by every loss.
    """

    logprobs: Tensor
    """[B, T] log-probs of the sampled tokens under the current policy (carries the gradient)."""
    old_logprobs: Tensor
    """[B, T] log-probs under the proximal ("old") policy that the PPO ratio is taken against."""
    advantages: Tensor
    """[B, T] per-token advantages (GRPO broadcasts one value per sequence over its tokens)."""
    loss_mask: Tensor
    """[B, T] float 1 where a token is trained on, 0 for padding and tool/env tokens."""
    ref_logprobs: Tensor | None = None
    """[B, T] log-probs under the frozen reference model; needed only when the KL term is on."""
    rollout_logprobs: Tensor | None = None
    """[B, T] log-probs reported by the rollout engine (for importance-sampling corrections)."""
    entropy: Tensor | None = None
    """[B, T] entropy of the current policy at each position (for the entropy bonus)."""

    def __post_init__(self) -> None:
        shape = self.logprobs.shape
        if self.logprobs.dim() != 2:
            raise ValueError(f"LossInputs.logprobs must be 2-D [B, T], got shape {tuple(shape)}")
        for name in _REQUIRED + _OPTIONAL:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"LossInputs.{name} must be a torch.Tensor, got {type(value)}")
            if value.shape != shape:
                raise ValueError(
                    f"LossInputs.{name} has shape {tuple(value.shape)}, expected {tuple(shape)} "
                    "(the shape of logprobs, [B, T] over response tokens)"
                )
            if not value.is_floating_point():
                raise ValueError(
                    f"LossInputs.{name} must be a floating-point tensor, got {value.dtype} "
                    "(convert a bool/int mask with .float())"
                )
        for name in _NO_GRAD:
            value = getattr(self, name)
            if value is not None and value.requires_grad:
                raise ValueError(
                    f"LossInputs.{name} requires grad; pass it detached (.detach()) so only "
                    "logprobs carries the gradient"
                )

    @property
    def shape(self) -> torch.Size:
        """[B, T]."""
        return self.logprobs.shape

    def zero_padding(self) -> LossInputs:
        """Return a copy where every per-token tensor is 0 at padded positions.

        Padding may hold anything (NaN from a masked softmax, stale values); a NaN there would
        survive ``x * 0`` and reach the gradient even through ``torch.where``, so losses replace
        it before doing any arithmetic.
        """
        keep = self.loss_mask > 0
        changes: dict[str, Tensor] = {}
        for name in _REQUIRED + _OPTIONAL:
            value = getattr(self, name)
            if value is not None and name != "loss_mask":
                changes[name] = torch.where(keep, value, torch.zeros_like(value))
        return dataclasses.replace(self, **changes)
