"""Weights to vLLM servers on GPUs of their own, through vLLM 0.32's built-in NCCL engine.

The servers run `--weight-transfer-config '{"backend": "nccl"}'` (vllm.weight_transfer 'nccl',
or 'auto' for servers on GPUs of their own). vLLM's trainer-side helper for that engine needs
vLLM in the trainer's environment, which the trainer image does not have (vLLM's transformers
pin is not ours), so this process takes the engine's other rendezvous, the one vLLM keeps for
trainers without it: it mints an NCCL unique id (torch.cuda.nccl) and hands it to every server.

1. form: `POST /init_weight_transfer_engine {"init_info": {nccl_unique_id_b64, rank_offset,
   world_size, packed: false}}` on every server at once while this process makes its
   communicator as rank 0 from the same id; both sides then issue the one-element all_reduce
   vLLM's communicator starts with (PyNcclCommunicator.from_unique_id_bytes), before anything
   else.
2. update (VLLMSender's pause, start, buckets, finish, cache reset, resume): per bucket, `POST
   /update_weights {"update_info": {names, dtype_names, shapes}}` on every server while rank 0
   broadcasts each tensor of the bucket in that order, one NCCL broadcast each (the engine's
   unpacked mode, which loads each tensor as it arrives).

The NCCL builds of the two sides are separate (the trainer's torch and the server's); the
trainer's is logged at formation, beside the group.
"""

from __future__ import annotations

import base64
import logging
import threading
from typing import Any

import torch

from relax_core.sync.buckets import Bucket
from relax_core.sync.vllm import VLLMSender

log = logging.getLogger(__name__)


def init_info(uid: bytes, rank_offset: int, world_size: int) -> dict[str, Any]:
    """The `init_info` of vLLM's NCCL engine (NCCLWeightTransferInitInfo) for a server whose
    ranks start at `rank_offset`: the unique-id rendezvous (standard base64 of the 128 bytes),
    unpacked broadcasts."""
    return {
        "nccl_unique_id_b64": base64.b64encode(uid).decode("ascii"),
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": False,
    }


class NcclComm:
    """Rank 0 of an NCCL communicator made from a unique id, on `device`."""

    def __init__(self, uid: bytes, world: int, device: torch.device) -> None:
        from torch.cuda import nccl

        self.device = device
        with torch.cuda.device(device):
            self.comm = nccl.init_rank(world, uid, 0)  # returns once every rank joined
            warm = torch.zeros(1, device=device)  # the handshake vLLM's side issues first
            nccl.all_reduce([warm], comms=[self.comm])
            torch.cuda.current_stream(device).synchronize()
        self.world = world

    def broadcast(self, tensor: torch.Tensor) -> None:
        from torch.cuda import nccl

        nccl.broadcast([tensor], root=0, comms=[self.comm])


def nccl_version() -> str:
    """The trainer's NCCL build, as 'major.minor.patch'."""
    from torch.cuda import nccl

    version = nccl.version()
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


class VLLMNcclSender(VLLMSender):
    """Rank 0 of an NCCL group whose other ranks are vLLM servers' GPU workers."""

    transport = "nccl"

    def __init__(self, engines: Any, specs: list[Any], **options: Any) -> None:
        super().__init__(engines, specs, **options)
        self._uids: dict[str, bytes] = {}
        self._uid_lock = threading.Lock()

    def _uid(self, group: str) -> bytes:
        """The unique id of group `group`, minted once (join requests ask from pool threads)."""
        from torch.cuda import nccl

        with self._uid_lock:
            if group not in self._uids:
                self._uids = {group: nccl.unique_id()}
            return self._uids[group]

    def _join_request(
        self, name: str, url: str, offset: int, world: int, port: int, group: str
    ) -> Any:
        return self._init_engine(name, url, init_info(self._uid(group), offset, world), "nccl")

    def _join(self, port: int, world: int, group: str) -> Any:
        comm = NcclComm(self._uid(group), world, self.device)
        log.info("NCCL weight group %s: trainer NCCL %s, world %d", group, nccl_version(), world)
        return comm

    def _send_bucket(
        self, bucket: Bucket, tensors: dict[str, torch.Tensor], version: int | None
    ) -> None:
        futures = self._post_update_info(bucket)
        stream = torch.cuda.current_stream(self.device)
        for spec in bucket.specs:
            tensor = tensors[spec.name].to(self.device, getattr(torch, spec.dtype))
            self.group.broadcast(tensor.contiguous())
        stream.synchronize()  # the tensors above stay alive until their broadcasts ran
        for n, future in futures:
            self._result(n, future)


def vllm_sender_class(cfg: Any, colocated: bool = False) -> type[VLLMSender]:
    """The sender for a run's vllm.weight_transfer (resolved as its servers resolve it)."""
    from relax_core.rollout.vllm_server import transfer_backend

    return VLLMNcclSender if transfer_backend(cfg, colocated) == "nccl" else VLLMSender
