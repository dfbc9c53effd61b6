"""`relax_gloo`: a vLLM weight-transfer engine over a gloo broadcast, for trainers and servers on CPUs.

vLLM 0.32 ships NCCL and CUDA IPC engines (GPUs only). This one is registered through vLLM's
plugin entry point (`vllm.general_plugins`, see pyproject.toml), so a server started with
`--weight-transfer-config '{"backend": "relax_gloo"}'` takes weights over its RL API:

- `POST /init_weight_transfer_engine {"init_info": {master_address, master_port, world_size,
  rank_offset, group_name, timeout_s}}`: each worker joins a gloo group of `world_size` ranks at
  rank `rank_offset + its rank` (tensor-parallel rank); the trainer is rank 0 and hosts the TCP
  store at master_address:master_port. The call returns once the group is formed.
- `POST /start_weight_update`, then per bucket `POST /update_weights {"update_info": {names,
  dtype_names, shapes}}` while rank 0 broadcasts the bucket as one flat uint8 tensor (the
  tensors back to back, in order, each contiguous), then `POST /finish_weight_update
  {"weight_version"}`.

Weights load through vLLM's layerwise reload (as its NCCL engine does), so a layer's kernels
are processed again after its new weights arrive. A model whose output head is tied to its input
embedding (`tie_word_embeddings`) gets the head re-tied after the reload: the reload rebuilds the
embedding's parameter and leaves the head reading the old one, so log-probs would come from the
new body and the old head.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

BACKEND = "relax_gloo"


def register() -> None:
    """vLLM calls this in each of its processes (the `vllm.general_plugins` entry point)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "relax_vllm_weights.engine", "GlooWeightTransferEngine"
        )


@dataclass
class GlooInitInfo:
    master_address: str
    master_port: int
    world_size: int
    rank_offset: int
    group_name: str
    timeout_s: float = 600.0


@dataclass
class GlooUpdateInfo:
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


def gloo_group(info: GlooInitInfo, rank: int) -> Any:
    """A gloo process group of its own (not torch.distributed's default group, which vLLM's
    workers hold): a TCP store at master_address:master_port hosted by rank 0, prefixed with the
    group name. The trainer builds its end with the same function."""
    import torch.distributed as dist

    if not 0 <= rank < info.world_size:
        raise ValueError(f"rank {rank} is outside a weight group of {info.world_size}")
    timeout = timedelta(seconds=info.timeout_s)
    store = dist.TCPStore(
        info.master_address,
        int(info.master_port),
        info.world_size,
        is_master=rank == 0,
        timeout=timeout,
    )
    prefixed = dist.PrefixStore(info.group_name, store)
    return dist.ProcessGroupGloo(prefixed, rank, info.world_size, timeout)
