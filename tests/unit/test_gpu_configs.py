"""The GPU stacks' configs: the shipped cluster configs load and add up, and the SGLang engine,
FSDP2 and Megatron settings are checked with messages that name the field."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relax_core.config import ConfigError, load_config, replace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(name: str):
    return load_config(os.path.join(REPO, "configs", f"{name}.yaml"))


@pytest.mark.parametrize(
    ("name", "mode", "gpus"),
    [("qwen3-4b-8xgpu", "async", 8), ("qwen3-30b-a3b-moe-r3", "async", 16)],
)
def test_async_gpu_configs_run_sglang_engines_and_add_up(name, mode, gpus):
    cfg = _cfg(name)
    assert cfg.run_name == name and cfg.mode == mode
    assert cfg.rollout.engine == "sglang" and cfg.services.sync_backend == "nccl"
    assert cfg.model.dtype == "bfloat16" and cfg.rollout.max_staleness >= 1
    s = cfg.services
    assert s.trainer_gpus + s.rollout_workers * s.rollout_gpus == gpus


def test_the_colocate_config_shares_the_gpus_through_memory_release():
    cfg = _cfg("qwen3-4b-8xgpu-colocate")
    assert cfg.mode == "colocate" and cfg.rollout.max_staleness == 0
    assert cfg.rollout.engine == "sglang" and cfg.sglang.release_memory
    assert cfg.sglang.handoff_dir.startswith("/dev/shm")
    assert "--dp-size 8" in cfg.sglang.extra_args
    # Same task and algorithm as the async config, so the two compare in MLflow.
    async_cfg = _cfg("qwen3-4b-8xgpu")
    assert (cfg.model, cfg.data, cfg.reward) == (async_cfg.model, async_cfg.data, async_cfg.reward)


def test_the_moe_config_replays_routes_on_megatron():
    cfg = _cfg("qwen3-30b-a3b-moe-r3")
    assert cfg.train.routing_replay and cfg.train.backend == "megatron"
    p = cfg.train.parallel
    assert (p.tensor, p.expert, p.pipeline, p.context) == (1, 8, 1, 1)
    assert cfg.services.trainer_gpus % (p.tensor * p.pipeline * p.context) == 0


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        (
            {"rollout": {"engine": "sglang"}, "sglang": {"pause_mode": "later"}},
            "sglang.pause_mode: 'later' is not one of retract, in_place, abort",
        ),
        (
            {"rollout": {"engine": "sglang"}, "sglang": {"mem_fraction_static": 1.5}},
            "sglang.mem_fraction_static: must be in (0, 1], got 1.5",
        ),
        (
            {"rollout": {"engine": "sglang"}, "sglang": {"url": "localhost:30000"}},
            "sglang.url: must start with http:// or https://, got 'localhost:30000'",
        ),
        (
            {
                "mode": "async",
                "rollout": {"engine": "sglang", "max_staleness": 1},
                "services": {"weight_sync": "object_store"},
            },
            "services.weight_sync: 'object_store' with rollout.engine 'sglang'",
        ),
        ({"train": {"moe_aux_loss_coef": -0.1}}, "train.moe_aux_loss_coef: must be >= 0"),
        (
            {
                "model": {"kind": "tiny-qwen3", "num_experts": 4, "experts_per_token": 2},
                "train": {
                    "backend": "megatron",
                    "routing_replay": True,
                    "parallel": {"tensor": 2},
                },
                "services": {"trainer_gpus": 2},
            },
            "train.parallel.tensor: 2 with an MoE policy needs sequence parallel",
        ),
        (
            {
                "mode": "async",
                "rollout": {"engine": "sglang", "max_staleness": 1},
                "sglang": {"extra_args": "--dp-size 2"},
            },
            "sglang.extra_args: --dp-size 2 in async mode: SGLang 0.5.23 refuses weight updates",
        ),
        (
            {"rollout": {"engine": "sglang"}, "sglang": {"extra_args": "--dp-size many"}},
            "sglang.extra_args: --dp-size needs a count >= 1, got 'many'",
        ),
        ({"train": {"backend": "deepspeed"}}, "train.backend: 'deepspeed' is not one of"),
        (
            {"train": {"backend": "fsdp", "parallel": {"tensor": 2}}},
            "train.parallel.tensor: 2 needs train.backend 'megatron'",
        ),
        (
            {
                "train": {"backend": "megatron", "parallel": {"tensor": 2}},
                "services": {"trainer_gpus": 3},
            },
            "services.trainer_gpus: 3 is not a multiple of train.parallel tensor x pipeline x "
            "context = 2",
        ),
        (
            {
                "train": {"backend": "megatron", "parallel": {"pipeline": 2}},
                "services": {"trainer_gpus": 2},
            },
            "train.parallel.pipeline: the Megatron backend runs pipeline parallel 1",
        ),
        (
            {
                "train": {"backend": "megatron", "parallel": {"expert": 3}},
                "services": {"trainer_gpus": 4},
            },
            "train.parallel.expert: 3 must divide the GPUs of one pipeline stage",
        ),
        ({"train": {"parallel": {"expert": 0}}}, "train.parallel.expert: must be >= 1, got 0"),
        (
            {"services": {"accelerator": "h100"}},
            "services.accelerator: 'h100' is not an NVIDIA accelerator name",
        ),
        (
            {"services": {"accelerator": "nvidia h100"}},
            "services.accelerator: 'nvidia h100' is not an NVIDIA accelerator name",
        ),
        ({"cluster": {"step_budget_s": 0}}, "cluster.step_budget_s: must be > 0 seconds, got 0"),
        (
            {"rollout": {"engine": "sglang"}, "sglang": {"api_key_secret": "Relax_Key"}},
            "sglang.api_key_secret: 'Relax_Key' is not a Kubernetes secret name",
        ),
        (  # SGLang refuses a whole /generate batch whose prompt plus max_new_tokens passes it
            {
                "rollout": {"engine": "sglang", "max_new_tokens": 256},
                "sglang": {"extra_args": "--context-length=256"},
            },
            "rollout.max_new_tokens: 256 leaves no room for a prompt in the SGLang server's "
            "context of 256 tokens",
        ),
    ],
)
def test_gpu_stack_settings_are_checked(sections, expected):
    base = _cfg("cpu-default")
    with pytest.raises(ConfigError) as err:
        replace(base, **sections)
    assert expected in str(err.value)


def test_the_sglang_engine_refuses_a_media_policy():
    base = _cfg("cpu-omni")
    with pytest.raises(ConfigError, match="rollout.engine: 'sglang' sends text token ids"):
        replace(base, rollout={"engine": "sglang"})


F32 = {"model": {"matmul_dtype": ""}}
"""cpu-async.yaml's bf16 matmuls are a torch-backend setting: a config moved to FSDP drops them."""


def test_a_multi_gpu_trainer_outside_torchrun_is_named(monkeypatch):
    from relax_core.train.factory import make_backend

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = replace(_cfg("cpu-async"), train={"backend": "fsdp"}, services={"trainer_gpus": 2}, **F32)
    with pytest.raises(RuntimeError, match="trainer_gpus is 2 but this trainer has 1 rank"):
        make_backend(None, cfg)


def test_a_multi_gpu_trainer_is_launched_under_torchrun():
    from relax_core.ops.processes import role_launcher

    cfg = replace(_cfg("cpu-async"), train={"backend": "fsdp"}, services={"trainer_gpus": 4}, **F32)
    cmd = role_launcher(cfg, "trainer")
    assert cmd[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    assert cmd[-3:] == ["-m", "relax_core.entrypoints.role", "trainer"]
    assert role_launcher(cfg, "rollout")[1:] == ["-m", "relax_core.entrypoints.role", "rollout"]


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"services": {"trainer_gpus": 2}}, "services.trainer_gpus: 2 GPUs need train.backend"),
        (
            {
                "mode": "colocate",
                "rollout": {"max_staleness": 0},
                "train": {"backend": "fsdp"},
                "services": {"trainer_gpus": 2},
            },
            "services.trainer_gpus: 2 needs mode 'async'",
        ),
    ],
)
def test_a_trainer_over_several_gpus_needs_a_sharding_backend_and_async_mode(sections, expected):
    with pytest.raises(ConfigError) as err:
        replace(_cfg("cpu-async"), **sections)
    assert expected in str(err.value)


FSDP_ONE_RANK = """
import torch
from relax_core.config import load_config, replace
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.train.batch import make_micro_batch
from relax_core.train.factory import make_backend
cfg = replace(
    load_config("configs/cpu-default.yaml"),
    train={"backend": "fsdp", "lr": 0.01},
    model={"matmul_dtype": ""},  # FSDP2 has its own mixed precision (model.dtype)
)
tok = build_char_tokenizer()
model = build_tiny_qwen3(cfg.model, len(tok), seed=0)
backend = make_backend(model, cfg)
mb = make_micro_batch([[1, 5, 6]], [[7, 8]], [[1, 1]], tok.pad_token_id)
before = backend.logprobs([mb])[0]
loss = lambda lp, ent, mb: (-(lp * mb.loss_mask).sum() / mb.loss_mask.sum(), {})
for _ in range(3):
    backend.train_step([mb], loss)
after = backend.logprobs([mb])[0]
print(float(before.sum()), float(after.sum()), type(backend).__name__)
"""


@pytest.mark.slow
def test_the_fsdp_backend_trains_as_a_one_rank_trainer():
    out = subprocess.run(
        [sys.executable, "-c", FSDP_ONE_RANK], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    before, after, name = out.stdout.split()
    assert name == "FSDPBackend"
    assert float(after) > float(before)  # three steps of raising the responses' likelihood
