"""The TrainBackend protocol: what the trainer and forward-only roles need from a training stack."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

import torch

from relax_core.train.batch import MicroBatch

MASTER_WEIGHTS_FILE = "master.safetensors"
"""A checkpoint's float32 master weights when the policy beside them is saved in a narrower
dtype (bf16): what a resumed trainer continues from, so a resume loses no update."""

# (logprobs [B, R], entropy [B, R], micro-batch) -> (loss to backpropagate, scalar metrics)
MicroBatchLoss = Callable[
    [torch.Tensor, torch.Tensor, MicroBatch], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


class TrainBackend(Protocol):
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Per-token log-probs [B, R] of each micro-batch's responses, without gradients."""
        ...

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: MicroBatchLoss
    ) -> dict[str, float]:
        """One optimizer step over all micro-batches (gradients accumulate); returns metrics."""
        ...

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Current weights in the dtype the engines hold (`model.dtype`), for the weight-sync
        transports."""
        ...

    def save(self, directory: str) -> None:
        """Write model (safetensors), tokenizer and optimizer state into `directory`."""
        ...

    def load(self, directory: str) -> None:
        """Restore what `save` wrote."""
        ...
