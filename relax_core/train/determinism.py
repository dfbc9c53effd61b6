"""`train.deterministic`: what a process sets so that a run repeats bit for bit.

torch's deterministic kernels where an op has a faster nondeterministic one (warn_only: an op
with no deterministic kernel warns, naming itself, instead of failing the run). Every process of
a run calls this at its start: the colocate session, the async roles, the whole-run entry point.
The async trainer also fixes its thread count (roles/trainer_service.py); what is and is not
reproducible is in docs/operations.md#reproducibility.
"""

from __future__ import annotations

import torch
import torch.utils.deterministic


def use_deterministic_kernels(on: bool) -> None:
    """Turn torch's deterministic kernels on or off for this process."""
    torch.use_deterministic_algorithms(on, warn_only=True)
    if on:
        # Filling every new tensor with NaN exposes reads of uninitialised memory, a debugging
        # aid that costs time on each allocation and changes no result.
        torch.utils.deterministic.fill_uninitialized_memory = False
