"""Sharing the CPU cores of one machine between local role processes.

When every role runs on the same machine (local async mode), a rollout worker waiting at the
staleness bound leaves its core idle. Roles mark themselves busy while they compute (a file
`{dir}/{role}-{worker}` holding their thread count, created on entry and removed on exit); the
trainer, if its thread count is elastic, takes the cores nobody else is using before each
micro-batch. On a cluster every role has its own pod and this is off.

The supervisor turns it on by setting RELAX_CORE_SHARE=<dir>:<cores> for its children.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

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
