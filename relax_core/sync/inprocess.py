"""In-process weight sync (colocate mode): copy trainer tensors into engines in the same process."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from relax_core.rollout.engine import RolloutEngine


class InProcessSync:
    def __init__(self, engines: list[RolloutEngine]) -> None:
        self.engines = engines

    def init(self) -> None:
        pass

    def pause(self) -> None:
        for engine in self.engines:
            engine.pause()

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        # One engine (colocate) takes the tensors as they come: a trainer's named weights may
        # be cast or gathered copies, and a list of them would be a second model in memory.
        tensors = named_tensors if len(self.engines) == 1 else list(named_tensors)
        for engine in self.engines:
            engine.update_weights(tensors, version)

    def resume(self) -> None:
        for engine in self.engines:
            engine.resume()

    def destroy(self) -> None:
        self.engines = []

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """pause -> send -> resume: one complete update."""
        self.pause()
        try:
            self.send(named_tensors, version)
        finally:
            self.resume()
