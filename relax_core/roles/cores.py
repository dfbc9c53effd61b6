"""Sharing the CPU cores of one machine between local role processes.

When every role runs on the same machine (local async mode), a rollout worker waiting at the
staleness bound leaves its core idle. Roles mark themselves busy while they compute (a file
`{dir}/{role}-{worker}` holding their thread count, created on entry and removed on exit); the
trainer, if its thread count is elastic, takes the cores nobody else is using before each
micro-batch and before each decoder layer's forward and backward (`check_cores_per_layer`): a
rollout that finishes generating in the middle of a training step frees its core for the rest
of that step. On a cluster every role has its own pod and this is off.

The supervisor turns it on by setting RELAX_CORE_SHARE=<dir>:<cores> for its children.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

ENV = "RELAX_CORE_SHARE"


class CoreShare:
    def __init__(self, directory: str, cores: int, me: str) -> None:
        if cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores}")
        self.directory = directory
        self.cores = cores
        self.me = me
        os.makedirs(directory, exist_ok=True)

    @classmethod
    def from_env(cls, me: str) -> CoreShare | None:
        value = os.environ.get(ENV, "")
        if not value:
            return None
        directory, _, cores = value.rpartition(":")
        if not directory or not cores.isdigit():
            raise ValueError(f"{ENV} must be '<dir>:<cores>', got {value!r}")
        return cls(directory, int(cores), me)

    @contextlib.contextmanager
    def busy(self, threads: int) -> Iterator[None]:
        """Mark this role as computing with `threads` threads for the duration of the block."""
        path = os.path.join(self.directory, self.me)
        with open(path, "w") as f:
            f.write(str(threads))
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def used_by_others(self) -> int:
        used = 0
        for name in os.listdir(self.directory):
            if name == self.me or name.startswith("."):
                continue
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(self.directory, name)) as f,
            ):
                used += int(f.read() or 0)
        return used

    def free(self) -> int:
        """Cores not marked busy by another role (at least 1: this role still runs)."""
        return max(1, self.cores - self.used_by_others())


def check_cores_per_layer(model, take: Callable[[], None]) -> int:
    """Call `take` before each decoder layer's forward and before its backward, so an elastic
    trainer changes its thread count inside a step (a rollout engine that finishes generating
    mid-step frees its core for the rest of the step, not the next one). Returns how many
    layers were hooked (0 for a model without transformers' decoder layers)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    layers = getattr(decoder, "layers", None) or []
    for layer in layers:
        layer.register_forward_pre_hook(lambda _module, _args: take())
        layer.register_full_backward_pre_hook(lambda _module, _grad: take())
    return len(layers)
