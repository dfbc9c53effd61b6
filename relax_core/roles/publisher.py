"""How the async trainer hands each version's weights to the engines (`WeightPublisher`).

A push goes through the run's weight-sync sender (broadcast group or object store); over
broadcast, a group that lost a member, or has one waiting to join, is formed again first and
the update goes to all. On a trainer that is one CPU process with the torch backend a push may
overlap the next step (`overlaps`): it runs in a thread while the trainer batches, forwards
and backwards, and `finish` (which the backend calls before its next optimizer step, and the
trainer before a checkpoint and at its end) waits for it and raises what it raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


def overlaps(cfg, backend) -> bool:
    """Whether weight pushes may overlap the next step: a single CPU process training with the
    torch backend, whose `named_weights` reads its own parameters (sharded and multi-rank
    backends gather them with collectives of the training group, which must not run beside
    the step's own; a GPU push would share the device's streams with the step)."""
    return (
        cfg.train.backend == "torch"
        and cfg.services.trainer_gpus <= 1
        and not torch.cuda.is_available()
        and hasattr(backend, "before_update")
    )


class WeightPublisher:
    def __init__(self, sender: Any, named_weights: Callable[[], Any], overlap: bool) -> None:
        self.sender = sender
        self.named_weights = named_weights
        """A function: each transport streams a pass of its own, bucket by bucket, and an
        update sent again after a group re-forms is read again."""
        self.overlap = overlap
        self.reforms = 0
        self._thread: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._waited = 0.0

    def init(self) -> None:
        """Form the weight-sync group (broadcast: blocks until the engines joined)."""
        self.sender.init()

    def publish(self, version: int, wait: bool = True) -> None:
        """Push the current weights as `version`; with `wait` False (and `overlap`) in a thread
        that `finish` waits for."""
        self.finish()
        if wait or not self.overlap:
            self._push(version)
            return

        def push() -> None:
            try:
                self._push(version)
            except BaseException as exc:  # re-raised by finish, in the trainer's loop
                self._errors.append(exc)

        self._thread = threading.Thread(target=push, name=f"publish-v{version}", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def finish(self) -> None:
        """Wait for a push in flight; raise what it raised."""
        if self._thread is not None:
            t0 = time.perf_counter()
            self._thread.join()
            self._waited += time.perf_counter() - t0
            self._thread = None
        if self._errors:
            raise self._errors.pop()

    def check(self) -> None:
        """Raise now what a push that already ended raised (a waiting trainer would otherwise
        wait for rows its engines, without the weights, never generate)."""
        if self._thread is not None and not self._thread.is_alive():
            self.finish()

    def needs_reform(self) -> bool:
        """A member waits to join or left (broadcast); never while a push is in flight."""
        return not self.in_flight and getattr(self.sender, "needs_reform", lambda: False)()

    def take_waited(self) -> float:
        """Seconds `finish` waited since the last call."""
        waited, self._waited = self._waited, 0.0
        return waited

    def close(self) -> None:
        """Finish a push in flight, then end the engines' loops (STOP) and leave the group."""
        try:
            self.finish()
        finally:
            self.sender.destroy()

    def _push(self, version: int) -> None:
        if not hasattr(self.sender, "push_or_reform"):
            self.sender.push(self.named_weights(), version)
            return
        if self.sender.push_or_reform(self.named_weights, version):
            self.reforms += 1
            log.warning("weight sync group formed again (generation %d)", self.sender.generation)
