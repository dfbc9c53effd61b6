"""A process group of its own between the trainer and processes that are not our receivers.

SGLang servers join the trainer's weight group through `/init_weights_update_group`: every rank
rendezvouses at `tcp://{master_address}:{master_port}` (rank 0, the trainer, hosts the TCP
store), the store is prefixed with the group name, and a group is built on it beside whatever
default group the process already has (SGLang's TP group; a trainer's own group over its
GPUs). Both ends must build it the same way, hence one function; the broadcast transport
(broadcast.py) builds its groups on its own store with the same helper. It uses torch's `_new_process_group_helper`, the
only way torch offers to build a second "world" in one process (SGLang, veRL and OpenRLHF do
the same); its signature is read at run time because it changes between torch releases.
"""

from __future__ import annotations

import contextlib
import inspect
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def join_weight_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float,
) -> Any:
    """Join (rank 0: host) the group `group_name`; returns the ProcessGroup for collectives."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    return group_on_store(backend, store, rank, world_size, group_name, timeout)


def group_on_store(
    backend: str, store: Any, rank: int, world_size: int, group_name: str, timeout: timedelta
) -> Any:
    """A process group of its own over `store` (ranks = global ranks 0..world_size-1), beside
    whatever default group this process has or lacks: a trainer over several GPUs holds its
    own default group, and weight sync must not take it. Collectives name it (`group=`)."""
    prefixed = c10d.PrefixStore(group_name, store)
    params = inspect.signature(c10d._new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        prefixed,
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_weight_group(group: Any) -> None:
    with contextlib.suppress(Exception):
        dist.destroy_process_group(group)
