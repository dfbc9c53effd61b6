"""Weight sync protocol: how a persistent trainer hands policy version v to rollout engines.

Five verbs, in this order per update: `pause` (engines stop taking work), `send` (weights, possibly
in bounded buckets), `resume` (engines serve version v). `init`/`destroy` open and close the
transport (a process group, a storage prefix). Transports: in-process (colocate); broadcast group
and object store come with async mode.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch


class WeightSync(Protocol):
    def init(self) -> None: ...

    def pause(self) -> None: ...

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None: ...

    def resume(self) -> None: ...

    def destroy(self) -> None: ...
