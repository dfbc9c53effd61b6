"""Supervised warm start: a few steps of next-token loss on prompt -> response, so RL begins from a
policy that is sometimes right. Reuses the torch backend with a cross-entropy micro-batch loss
over the tokens each example's loss_mask marks (a multi-turn demonstration's model turns, never
its observations)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch

from relax_core.train.batch import MicroBatch, make_micro_batch
from relax_core.train.torch_backend import TorchBackend

Example = tuple[list[int], list[int], list[int]]
"""(prompt_ids, response_ids, loss_mask): one supervised example."""


def _ce_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
    loss = -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
    return loss, {"sft_loss": loss.detach()}


def answer_example(tokenizer: Any, prompt_ids: list[int], answer: str) -> Example:
    """A single-turn example: the answer's tokens and EOS, all trained."""
    response = list(tokenizer(answer, add_special_tokens=False)["input_ids"])
    response.append(tokenizer.eos_token_id)
    return prompt_ids, response, [1] * len(response)


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    media: list | None = None,
) -> list[float]:
    """Train `model` in place on (prompt_ids, response_ids, loss_mask) examples; returns the
    loss per step. `media`: each example's encoder inputs (an omni policy), in example order."""
    if not examples:
        raise ValueError("the warm start has no examples")
    backend = TorchBackend(model, lr=lr, grad_clip=1.0)
    rng = random.Random(seed)
    losses = []
    for _ in range(steps):
        picks = rng.sample(range(len(examples)), min(batch_size, len(examples)))
        mb = make_micro_batch(
            [examples[i][0] for i in picks],
            [examples[i][1] for i in picks],
            [examples[i][2] for i in picks],
            tokenizer.pad_token_id,
        )
        if media is not None:
            mb = dataclasses.replace(mb, media=[media[i] for i in picks])
        losses.append(backend.train_step([mb], _ce_loss)["sft_loss"])
    return losses
