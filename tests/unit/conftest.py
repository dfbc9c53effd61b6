"""Fixtures shared by unit test modules."""

from __future__ import annotations

import pytest

from tests import needs


@pytest.fixture(scope="module")
def megatron_group():
    """A world-size-1 gloo group with Megatron's model-parallel groups (all of size 1), for
    building Megatron models on CPU; skipped where megatron-core is not installed."""
    needs.module("megatron.core", "pip install -e '.[dev]' (megatron-core 0.16.1 on Python 3.11)")
    import torch.distributed as dist
    from megatron.core import parallel_state

    from relax_core.net import free_port

    if not dist.is_initialized():
        port = free_port("127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
