"""The placement plan: which GPUs each process of a run gets, from the config and the devices
visible, with no GPU used twice and a clear refusal when the run does not fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_core.config import replace
from relax_core.config.load import load_config
from relax_core.ops.placement import PlacementError, demand, describe, env_for, plan

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIGS = sorted(p.name for p in (REPO / "configs").glob("qwen3-*.yaml"))


@pytest.mark.parametrize("name", GPU_CONFIGS)
def test_every_shipped_gpu_config_uses_each_gpu_once(name: str) -> None:
    cfg = load_config(REPO / "configs" / name)
    need = sum(n for _, n, _ in demand(cfg))
    visible = [str(i) for i in range(need)]
    slots = plan(cfg, visible)
    placed = [d for s in slots for d in s.devices]
    assert sorted(placed, key=int) == visible, describe(slots)  # every GPU once, none twice
    # The trainer gets as many GPUs as it has ranks; each engine its server's.
    if cfg.mode == "async":
        trainer = next(s for s in slots if s.process == "trainer-0")
        assert len(trainer.devices) == cfg.services.trainer_gpus
        assert len([s for s in slots if s.process.startswith("rollout-")]) == (
            cfg.services.rollout_workers
        )


def test_the_8_gpu_async_config_gives_the_trainer_gpu_0_and_each_server_its_own() -> None:
    cfg = load_config(REPO / "configs" / "qwen3-4b-8xgpu.yaml")
    slots = plan(cfg, [str(i) for i in range(8)])
    env = {s.process: env_for(slots, s.process) for s in slots}
    assert env["trainer-0"] == {"CUDA_VISIBLE_DEVICES": "0"}
    assert [env[f"rollout-{i}"]["CUDA_VISIBLE_DEVICES"] for i in range(7)] == [
        str(i) for i in range(1, 8)
    ]
    assert env_for(slots, "advantages-0") == {"CUDA_VISIBLE_DEVICES": ""}, "CPU only"


def test_a_run_that_does_not_fit_is_refused_with_its_parts_counted() -> None:
    cfg = load_config(REPO / "configs" / "qwen3-4b-8xgpu.yaml")
    with pytest.raises(PlacementError) as err:
        plan(cfg, ["0", "1", "2", "3"])
    assert "needs 8 GPUs (trainer-0 1 + rollout-0 1" in str(err.value)
    assert "but 4 are visible" in str(err.value)


def test_devices_come_from_the_parents_visible_list_and_scaling_out_past_them_is_refused() -> None:
    cfg = replace(
        load_config(REPO / "configs" / "qwen3-vl-4b-8xgpu.yaml"),
        services={"trainer_gpus": 2, "rollout_workers": 2, "rollout_gpus": 1},
    )
    slots = plan(cfg, ["4", "5", "6", "7"])
    assert [(s.process, s.devices) for s in slots] == [
        ("trainer-0", ("4", "5")),
        ("rollout-0", ("6",)),
        ("rollout-1", ("7",)),
    ]
    with pytest.raises(PlacementError, match="no GPU left for rollout-2"):
        env_for(slots, "rollout-2")


def test_reference_and_actor_fwd_each_hold_a_gpu_when_the_run_has_them() -> None:
    cfg = replace(
        load_config(REPO / "configs" / "qwen3-4b-8xgpu.yaml"),
        services={"rollout_workers": 5, "actor_fwd": True},
        algorithm={"kl_coef": 0.01},
    )
    names = [s.process for s in plan(cfg, [str(i) for i in range(8)])]
    assert names[-2:] == ["reference-0", "actor_fwd-0"]


def test_a_cpu_run_sets_nothing() -> None:
    cfg = load_config(REPO / "configs" / "cpu-async.yaml")
    assert plan(cfg, []) == []
    assert env_for([], "trainer-0") == {}
    assert "every process runs on CPU" in describe([])
