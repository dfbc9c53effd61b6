"""How the trainer's weights reach vLLM servers, decided from the config and checked against the
pinned vLLM's own source: vLLM's NCCL engine for servers on GPUs of their own, relax_gloo (host
memory) on CPUs and beside a colocated trainer; what the trainer sends vLLM's NCCL engine is
what that engine's init and update types take (read from the environment's vLLM 0.32 source,
without importing it)."""

from __future__ import annotations

import ast
import base64
import dataclasses
import glob
import json
import os

import pytest

from relax_core.config import load_config, replace
from relax_core.config.checks import validate
from relax_core.rollout.vllm_server import launch_flags, transfer_backend
from relax_core.sync.vllm import VLLMSender
from relax_core.sync.vllm_nccl import VLLMNcclSender, init_info, vllm_sender_class
from tests.needs import vllm_python

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def config(name: str, **sections):
    return replace(load_config(os.path.join(REPO, "configs", name)), **sections)


def transfer_of(flags: list[str]) -> str:
    return json.loads(flags[flags.index("--weight-transfer-config") + 1])["backend"]


def test_each_shipped_vllm_config_gets_the_transfer_its_placement_allows():
    cpu = config("vllm-cpu.yaml")
    gpu_async = config("qwen3-4b-8xgpu-vllm.yaml")
    gpu_colocate = config("qwen3-4b-8xgpu-colocate-vllm.yaml")
    assert transfer_backend(cpu) == transfer_backend(cpu, colocated=True) == "relax_gloo"
    assert transfer_backend(gpu_async) == "nccl"
    assert vllm_sender_class(gpu_async) is VLLMNcclSender
    # A colocate server shares the trainer's GPU: host memory, and it sleeps while training.
    assert transfer_of(launch_flags(gpu_colocate, colocated=True)) == "relax_gloo"
    assert "--enable-sleep-mode" in launch_flags(gpu_colocate, colocated=True)
    assert vllm_sender_class(gpu_colocate, colocated=True) is VLLMSender
    assert "--enable-sleep-mode" not in launch_flags(cpu, colocated=True)  # vLLM refuses it there
    assert transfer_of(launch_flags(gpu_async)) == "nccl"
    forced = replace(gpu_async, vllm={"weight_transfer": "relax_gloo"})
    assert transfer_backend(forced) == "relax_gloo" and vllm_sender_class(forced) is VLLMSender


def with_transfer(name: str, transfer: str):
    """Config `name` with vllm.weight_transfer `transfer`, not validated (validate() is what
    the test calls)."""
    cfg = load_config(os.path.join(REPO, "configs", name))
    return dataclasses.replace(cfg, vllm=dataclasses.replace(cfg.vllm, weight_transfer=transfer))


def test_a_transfer_the_placement_cannot_run_is_refused_before_launch():
    errors = validate(with_transfer("vllm-cpu.yaml", "nccl"))
    assert any(e.startswith("vllm.weight_transfer: 'nccl' needs GPUs") for e in errors), errors
    colocate = with_transfer("qwen3-4b-8xgpu-colocate-vllm.yaml", "nccl")
    assert any("NCCL refuses two ranks on one device" in e for e in validate(colocate))
    odd = validate(with_transfer("vllm-cpu.yaml", "shm"))
    assert any(e.startswith("vllm.weight_transfer: 'shm' is not one of") for e in odd), odd
    ipc = validate(with_transfer("qwen3-4b-8xgpu-colocate-vllm.yaml", "ipc"))
    assert any("VLLM_ALLOW_INSECURE_SERIALIZATION" in e for e in ipc), ipc
    assert validate(with_transfer("qwen3-4b-8xgpu-vllm.yaml", "nccl")) == []


def _dataclass_fields(source: str, name: str) -> dict[str, bool]:
    """{field: has a default} of dataclass `name` in `source`."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {
                stmt.target.id: stmt.value is not None
                for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
            }
    raise AssertionError(f"no class {name} in vLLM's source")


def test_the_nccl_join_and_update_are_what_vllms_nccl_engine_takes():
    python = vllm_python()
    (site,) = glob.glob(
        os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "*", "site-packages")
    )
    where = os.path.join(site, "vllm", "distributed", "weight_transfer")
    with open(os.path.join(where, "nccl_common.py")) as f:
        init_fields = _dataclass_fields(f.read(), "NCCLWeightTransferInitInfo")
    with open(os.path.join(where, "nccl_engine.py")) as f:
        update_fields = _dataclass_fields(f.read(), "NCCLWeightTransferUpdateInfo")
    info = init_info(bytes(range(128)), rank_offset=3, world_size=9)
    assert set(info) <= set(init_fields)
    assert {k for k, has_default in init_fields.items() if not has_default} <= set(info)
    # One rendezvous only: the unique id, with no TCP address (vLLM refuses both at once).
    assert init_fields["master_address"] and "master_address" not in info
    assert base64.b64decode(info["nccl_unique_id_b64"], validate=True) == bytes(range(128))
    assert info["packed"] is False  # one broadcast per tensor, in the update's name order
    sent = {"names", "dtype_names", "shapes"}  # VLLMSender._post_update_info
    assert set(update_fields) == sent


@pytest.mark.parametrize("backend", ["nccl", "relax_gloo"])
def test_a_refused_join_names_the_engine_the_server_must_run(backend):
    class Refusing:
        url = "http://127.0.0.1:9"

        def post(self, path, body, timeout_s=None):
            from relax_core.rollout.server_client import ServerError

            raise ServerError(f"POST {self.url}{path}: HTTP 400: unknown backend")

    sender = VLLMSender.__new__(VLLMSender)
    sender._client = lambda name, url: Refusing()
    from relax_core.rollout.vllm_engine import VLLMError

    with pytest.raises(
        VLLMError, match=f"'{backend}' weight-transfer engine .*vllm.weight_transfer"
    ):
        sender._init_engine("e0", "http://127.0.0.1:9", {}, backend)
