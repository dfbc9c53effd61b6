"""Resumable prompt order: a per-epoch permutation plus a cursor into it.

The order of epoch ``e`` depends only on ``(seed, e)``, so the cursor (two ints) is the whole
state a checkpoint needs: a resumed run continues with exactly the prompts it would have seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DatasetCursor:
    """Position of the next prompt: ``index`` into the permutation of epoch ``epoch``."""

    epoch: int = 0
    """Number of full passes over the dataset already completed."""
    index: int = 0
    """Position in this epoch's permutation of the next prompt to hand out."""

    def __post_init__(self) -> None:
        for name in ("epoch", "index"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"DatasetCursor.{name} must be an int >= 0, got {value!r}")

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetCursor:
        missing = {"epoch", "index"} - set(data)
        if missing:
            raise ValueError(f"dataset cursor is missing {sorted(missing)}; got {data!r}")
        extra = set(data) - {"epoch", "index"}
        if extra:
            raise ValueError(f"dataset cursor has unknown keys {sorted(extra)}")
        return cls(epoch=data["epoch"], index=data["index"])


class PromptSampler:
    """Hands out ``(epoch, prompt_index)`` pairs in a deterministic, resumable order."""

    def __init__(self, num_prompts: int, seed: int, shuffle: bool = True) -> None:
        if num_prompts <= 0:
            raise ValueError(f"num_prompts must be > 0, got {num_prompts}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.num_prompts = num_prompts
        self.seed = seed
        self.shuffle = shuffle
        self._cached: tuple[int, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """Prompt indices of ``epoch`` in the order they are handed out. Shape: [num_prompts]."""
        if not self.shuffle:
            return np.arange(self.num_prompts)
        if self._cached is None or self._cached[0] != epoch:
            # Seeding with the (seed, epoch) pair makes each epoch independent of how many
            # epochs came before, which is what lets a cursor alone restore the order.
            rng = np.random.default_rng([self.seed, epoch])
            self._cached = (epoch, rng.permutation(self.num_prompts))
        return self._cached[1]

    def take(self, cursor: DatasetCursor, n: int) -> tuple[list[tuple[int, int]], DatasetCursor]:
        """Next ``n`` prompts after ``cursor``, wrapping into later epochs as needed.

        Returns the ``(epoch, prompt_index)`` pairs and the cursor just past them; a cursor that
        lands on the end of an epoch is returned as the start of the next one.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if cursor.index >= self.num_prompts:
            raise ValueError(
                f"dataset cursor index {cursor.index} is past the end of a dataset of "
                f"{self.num_prompts} prompts; was the dataset changed since the checkpoint?"
            )
        epoch, index = cursor.epoch, cursor.index
        out: list[tuple[int, int]] = []
        while len(out) < n:
            stop = min(self.num_prompts, index + n - len(out))
            out.extend((epoch, int(i)) for i in self.order(epoch)[index:stop])
            index = stop
            if index == self.num_prompts:
                epoch, index = epoch + 1, 0
        return out, DatasetCursor(epoch=epoch, index=index)
