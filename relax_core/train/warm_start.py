"""Supervised warm start: a few steps of next-token loss on prompt -> answer, so RL begins from a
policy that is sometimes right. Reuses the torch backend with a cross-entropy micro-batch loss."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from relax_core.train.batch import MicroBatch, make_micro_batch
from relax_core.train.torch_backend import TorchBackend


def _ce_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
    loss = -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
    return loss, {"sft_loss": loss.detach()}


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[tuple[list[int], str]],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    media: list | None = None,
) -> list[float]:
    """Train `model` in place on (prompt_ids, target_text) pairs; returns the loss per step.
    `media`: each example's encoder inputs (an omni policy), in example order."""
    targets = [tokenizer(t, add_special_tokens=False)["input_ids"] for _, t in examples]
    eos = tokenizer.eos_token_id
    backend = TorchBackend(model, lr=lr, grad_clip=1.0)
    rng = random.Random(seed)
    losses = []
    for _ in range(steps):
        picks = rng.sample(range(len(examples)), min(batch_size, len(examples)))
        responses = [targets[i] + [eos] for i in picks]
        mb = make_micro_batch(
            [examples[i][0] for i in picks],
            responses,
            [[1] * len(r) for r in responses],
            tokenizer.pad_token_id,
        )
        if media is not None:
            mb = dataclasses.replace(mb, media=[media[i] for i in picks])
        losses.append(backend.train_step([mb], _ce_loss)["sft_loss"])
    return losses
