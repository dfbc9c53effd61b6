"""What the broadcast sender and its receivers share: the wire format (headers, ops), the
rendezvous record's paths and states, member names, and how one generation's groups are built,
checked (the layout check) and left. broadcast.py says how the pieces are used."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relax_core.sync.process_group import group_on_store, leave_weight_group

UPDATE, END, STOP = 1, 2, 3
FORMING, FORMED = "forming", "formed"
"""Rendezvous record states: receivers join only a group that is still forming."""


class ProtocolError(RuntimeError):
    """The peers disagree about the wire protocol: a bug, never healed by joining again."""


OP_NAMES = {UPDATE: "UPDATE", END: "END", STOP: "STOP"}
POLL_S = 0.2
CONNECT_TRY_S = 5.0


def rendezvous_path(group: str) -> str:
    if not group or "/" in group:
        raise ValueError(f"weight sync group name must be non-empty without '/', got {group!r}")
    return f"control/rendezvous/{group}"


MEMBER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

Members = Sequence[str] | Callable[[], Sequence[str]]
"""Receiver names: fixed, or a function returning the ones wanted now."""


def check_member(name: str) -> str:
    if not isinstance(name, str) or not MEMBER_NAME.fullmatch(name):
        raise ValueError(
            f"weight sync member names are 1-128 letters, digits, '.', '_' or '-' (not "
            f"starting with a punctuation mark), got {name!r}"
        )
    return name


def waiting_path(group: str, member: str | None = None) -> str:
    """Where a receiver that waits for a group to join says so (`{member}`: its wait's start)."""
    base = f"{rendezvous_path(group)}.waiting"
    return base if member is None else f"{base}/{check_member(member)}"


def device_for(backend: str) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    raise ValueError(f"weight sync backend must be 'gloo' (CPU) or 'nccl' (CUDA), got {backend!r}")


def sync_groups(
    backend: str,
    tcp: Any,
    rank: int,
    world_size: int,
    nonce: str,
    timeout: timedelta,
    control_timeout: timedelta,
) -> tuple[Any, Any, torch.device]:
    """(data group, control group, control device) of one generation, on its own TCP store and
    named by its nonce, never the default group (a trainer over several GPUs holds that one).

    With NCCL, headers and the layout check travel over a gloo group of their own: a receiver
    waiting for the next update then blocks a CPU thread instead of keeping an NCCL kernel
    spinning on the GPU beside the engine's. With gloo one group carries both.
    """
    data = group_on_store(backend, tcp, rank, world_size, f"relax-{nonce}", timeout)
    if backend != "nccl":
        return data, data, device_for(backend)
    control = group_on_store("gloo", tcp, rank, world_size, f"relax-{nonce}-ctrl", control_timeout)
    return data, control, torch.device("cpu")


def leave_groups(*groups: Any) -> None:
    for group in dict.fromkeys(g for g in groups if g is not None):
        leave_weight_group(group)


def layout_check(
    fingerprint: str, n_tensors: int, bucket_bytes: int, group: Any, device: torch.device
) -> list[list[int]]:
    """Every rank's [fingerprint bytes..., n_tensors, bucket_bytes], gathered without pickle."""
    mine = torch.tensor(
        [*bytes.fromhex(fingerprint), n_tensors, bucket_bytes], dtype=torch.int64, device=device
    )
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return [r.tolist() for r in rows]


def describe_layout_row(row: list[int]) -> str:
    return f"fingerprint {bytes(row[:32]).hex()[:12]}, {row[32]} tensors, bucket_bytes {row[33]}"
