"""The trainer's end of vLLM's NCCL weight-transfer engine (sync/vllm_nccl.py) on a GPU: a
communicator made from a unique id the trainer mints, the one-element all_reduce vLLM's side
starts with, and a broadcast per tensor. vLLM cannot be installed on the lent GPU machines, so
this runs the trainer's side alone, as a group of one."""

from __future__ import annotations

import pytest
import torch

from relax_core.sync.vllm_nccl import NcclComm, nccl_version

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_communicator_from_a_minted_id_broadcasts_each_dtype():
    from torch.cuda import nccl

    device = torch.device("cuda", 0)
    comm = NcclComm(nccl.unique_id(), 1, device)
    for dtype in (torch.bfloat16, torch.float32):
        tensor = torch.arange(12, device=device, dtype=dtype).reshape(3, 4)
        comm.broadcast(tensor)
        torch.cuda.synchronize()
        assert torch.equal(tensor, torch.arange(12, device=device, dtype=dtype).reshape(3, 4))
    assert nccl_version().count(".") == 2
