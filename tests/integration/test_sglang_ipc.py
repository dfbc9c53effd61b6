"""The colocate handover to SGLang: CUDA IPC through /update_weights_from_tensor, files otherwise.

On CPU the handover goes through files (there are no CUDA IPC handles), and the stand-in's
/update_weights_from_tensor refuses what SGLang 0.5.23 refuses: a request outside a weight-update
session, a payload that is not base64, a pickle naming anything but tensors and containers. The
IPC path itself needs a GPU (`gpu` marker): the trainer's CUDA tensors are handed over by handle
and arrive bit-exact.
"""

from __future__ import annotations

import base64
import pickle

import pytest
import torch

from relax_core.rollout.sglang_colocate import ColocatedSGLang
from relax_core.rollout.sglang_engine import SGLangEngine, SGLangError
from tests.integration.test_sglang_contract import _digest, fake_servers
from tests.integration.weight_sync_actors import tiny_policy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server():
    with fake_servers(1) as (client,):
        yield client


def _by_value(named) -> str:
    """A payload SGLang accepts without IPC: CPU tensors pickled with their bytes."""
    return base64.b64encode(pickle.dumps([(n, t.detach().clone()) for n, t in named])).decode()


class _Evil:
    def __reduce__(self):
        return (print, ("unpickled",))


@pytest.mark.slow
def test_malformed_tensor_updates_are_refused_and_a_well_formed_one_loads(server):
    trainer, _ = tiny_policy(6)
    named = list(trainer.named_parameters())
    update = "/update_weights_from_tensor"
    with pytest.raises(SGLangError, match="HTTP 400.*missing field.*serialized_named_tensors"):
        server.post_ok(update, {"flush_cache": True})
    with pytest.raises(SGLangError, match="HTTP 400.*not base64"):
        server.post_ok(update, {"serialized_named_tensors": ["%%%"]})
    with pytest.raises(SGLangError, match="HTTP 400.*must run between begin_weight_update"):
        server.post_ok(update, {"serialized_named_tensors": [_by_value(named)]})
    server.post_ok("/begin_weight_update", {})
    try:
        with pytest.raises(SGLangError, match="HTTP 400.*already open"):
            server.post_ok("/begin_weight_update", {})
        evil = base64.b64encode(pickle.dumps([("x", _Evil())])).decode()
        with pytest.raises(SGLangError, match="HTTP 400.*Blocked unsafe global"):
            server.post_ok(update, {"serialized_named_tensors": [evil]})
        with pytest.raises(SGLangError, match="HTTP 400.*Unknown load_format"):
            body = {"serialized_named_tensors": [_by_value(named)], "load_format": "mine"}
            server.post_ok(update, body)
        body = {"serialized_named_tensors": [_by_value(named)], "weight_version": "6"}
        server.post_ok(update, body)
    finally:
        server.post_ok("/end_weight_update", {})
    assert server.get("/relax_test/digest") == _digest(named)
    assert SGLangEngine(server).refresh_version() == 6


@pytest.mark.slow
def test_tensor_updates_are_refused_by_a_server_with_data_parallel_replicas():
    with (
        fake_servers(1, "--dp-size", "2") as (client,),
        pytest.raises(SGLangError, match="HTTP 500.*data-parallel"),
    ):
        client.post_ok("/update_weights_from_tensor", {"serialized_named_tensors": ["AA=="]})


def test_cpu_weights_reach_a_colocated_server_through_files(server, tmp_path):
    trainer, _ = tiny_policy(8)
    named = list(trainer.named_parameters())
    colocated = ColocatedSGLang(SGLangEngine(server), str(tmp_path / "handoff"), str(tmp_path))
    started = len(server.get("/relax_test/events"))
    colocated.update_weights(iter(named), 8)
    loads = [e[2] for e in server.get("/relax_test/events")[started:] if e[1] == "update_begin"]
    assert loads == ["disk"]
    assert server.get("/relax_test/digest") == _digest(named)
    assert colocated.version == 8 and SGLangEngine(server).refresh_version() == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
def test_cuda_weights_reach_a_colocated_server_by_ipc_handles(tmp_path):
    with fake_servers(1, "--device", "cuda") as (client,):
        trainer, _ = tiny_policy(9)
        trainer = trainer.cuda()
        named = [(n, p.detach()) for n, p in trainer.named_parameters()]
        # Small buckets: several /update_weights_from_tensor calls in one session.
        colocated = ColocatedSGLang(
            SGLangEngine(client), str(tmp_path / "h"), str(tmp_path), bucket_bytes=8 << 10
        )
        colocated.update_weights(iter(named), 9)
        events = client.get("/relax_test/events")
        loads = [e[2] for e in events if e[1] == "update_begin"]
        assert len(loads) > 1 and set(loads) == {"tensor"}
        assert client.get("/relax_test/digest") == _digest([(n, t.cpu()) for n, t in named])
        consumed = set(client.get("/relax_test/loaded")["consumed"])
        assert {n for n, _ in named} <= consumed
        assert SGLangEngine(client).refresh_version() == 9
        assert not (tmp_path / "h").exists()  # nothing went through files
