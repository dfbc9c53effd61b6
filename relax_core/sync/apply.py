"""Hand-off of complete weight updates from a receiver's thread to the engine loop.

A receiver thread stages each update in buffers of its own and, once the update is complete, puts
it in an `UpdateSlot`; the engine loop takes it between generate calls and applies it with
`apply_update` (pause -> update_weights -> resume), so an engine never generates with a mix of
two versions. A newer complete update replaces an older one that nobody has taken yet.

`StagingPool` lets a receiver reuse staging buffers instead of allocating (and page-faulting)
a model's worth of memory per update: buffers come back only when provably unused, i.e. the
update was replaced before anyone took it, or its taker called `release` after copying it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch

from relax_core.rollout.engine import RolloutEngine


class UpdateTensors(list):
    """The (name, tensor) pairs of one update; weak-referenceable, so that a receiver learns when
    its taker drops it."""

    __slots__ = ("__weakref__",)


Update = tuple[int, list[tuple[str, torch.Tensor]]]
"""(policy_version, named tensors in layout order)."""


class UpdateSlot:
    """The newest complete update not yet taken, plus the receiver thread's end state."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: Update | None = None
        self._error: BaseException | None = None
        self._stopped = False

    def put(self, update: Update) -> Update | None:
        """Make `update` the pending one; returns the untaken update it replaces, if any."""
        with self._cond:
            replaced, self._pending = self._pending, update
            self._cond.notify_all()
            return replaced

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def take(self) -> Update | None:
        with self._cond:
            if self._error is not None:
                raise self._error
            update, self._pending = self._pending, None
            return update

    def wait(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(
                lambda: self._pending is not None or self._error is not None or self._stopped,
                timeout,
            )
            if self._error is not None:
                raise self._error
            return self._pending is not None


class StagingPool:
    """Staging buffer sets of a receiver: leased with each update, reused once given back."""

    def __init__(self, keep: int = 1) -> None:
        """`keep`: free sets held for reuse (0: always allocate, e.g. where an allocator caches)."""
        self.keep = keep
        # Re-entrant: a weakref callback (_forget) may run from a garbage collection that an
        # allocation inside a locked section set off.
        self._lock = threading.RLock()
        self._free: list[list[torch.Tensor]] = []
        self._leased: dict[int, tuple[weakref.ref, list[torch.Tensor]]] = {}

    @property
    def leased(self) -> int:
        """Sets handed out with an update that is still alive and not given back."""
        with self._lock:
            return len(self._leased)

    def acquire(self, make: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return make()

    def lease(self, tensors: UpdateTensors, buffers: list[torch.Tensor]) -> None:
        """Record that `tensors` (views into `buffers`) were handed out."""
        key = id(tensors)
        ref = weakref.ref(tensors, lambda _: self._forget(key))
        with self._lock:
            self._leased[key] = (ref, buffers)

    def release(self, tensors: list) -> None:
        """Take back the buffers behind `tensors`; nothing may use those tensors afterwards."""
        with self._lock:
            entry = self._leased.get(id(tensors))
            if entry is None or entry[0]() is not tensors:
                return  # not ours, or given back already
            del self._leased[id(tensors)]
            if len(self._free) < self.keep:
                self._free.append(entry[1])

    def _forget(self, key: int) -> None:
        # The taker dropped its update without release(): its buffers are freed as usual.
        with self._lock:
            entry = self._leased.get(key)
            if entry is not None and entry[0]() is None:
                del self._leased[key]


def apply_update(
    engine: RolloutEngine, update: Update, release: Callable[[Update], None] | None = None
) -> int:
    """Load `update` into `engine` at a safe point; returns the version it now serves.

    `release` (a receiver's `release`) gets the update back once the engine holds its own copy,
    so the receiver can reuse the staging buffers. If loading fails part way the engine stays
    paused (it refuses to generate) rather than serve a mix of two versions.
    """
    version, tensors = update
    engine.pause()
    engine.update_weights(tensors, version)
    engine.resume()
    if release is not None:
        release(update)
    return version
