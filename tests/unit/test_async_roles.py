"""Async-mode wiring that needs no process: which roles a config runs, their stages, the
members of the weight-sync group, config checks, and the local core share."""

from __future__ import annotations

import pytest

from relax_core.config import ConfigError, RunConfig, load_config, replace
from relax_core.ops.processes import roles_of
from relax_core.pool.engines import member_name, weight_members
from relax_core.queue import TransferQueue
from relax_core.roles.cores import CoreShare
from relax_core.roles.service import load_run_config, stage_chain
from relax_core.run.role_services import serve_fn


def _async(**sections) -> RunConfig:
    return replace(RunConfig(), mode="async", **sections)


def test_the_default_async_run_is_rollout_advantages_trainer(tmp_path):
    cfg = _async()
    assert stage_chain(cfg) == [("advantages", "rollout", "ready")]
    assert roles_of(cfg) == [("trainer", 0), ("rollout", 0), ("advantages", 0)]
    assert weight_members(cfg, TransferQueue(str(tmp_path), "r")) == ["rollout-0"]


def test_kl_teacher_and_actor_fwd_add_their_stages_in_order(tmp_path):
    cfg = _async(
        algorithm={"kl_coef": 0.1},
        services={"actor_fwd": True, "rollout_workers": 3},
    )
    assert stage_chain(cfg) == [
        ("reference", "rollout", "ref"),
        ("actor_fwd", "ref", "fwd"),
        ("advantages", "fwd", "ready"),
    ]
    assert [r for r, _ in roles_of(cfg)].count("rollout") == 3
    # weight sync: actor_fwd first (rank 1), then the engines in worker order
    members = weight_members(cfg, TransferQueue(str(tmp_path), "r"))
    assert members == ["actor_fwd-0", "rollout-0", "rollout-1", "rollout-2"]
    assert member_name("rollout", 2) == "rollout-2"
    with pytest.raises(ValueError, match="receives no weights"):
        member_name("advantages", 0)


def test_every_role_has_a_serve_function():
    for role in ("rollout", "reference", "actor_fwd", "advantages", "trainer"):
        assert callable(serve_fn(role))
    with pytest.raises(ValueError, match="unknown role"):
        serve_fn("critic")


def test_async_config_checks_name_the_field():
    with pytest.raises(ConfigError, match="services.launch"):
        _async(services={"launch": "ray"})
    with pytest.raises(ConfigError, match="services.weight_sync"):
        _async(services={"weight_sync": "carrier-pigeon"})
    assert _async(rollout={"dynamic_sampling": True}).rollout.dynamic_sampling  # DAPO works async
    with pytest.raises(ConfigError, match="rollout.dynamic_sampling: needs n_samples_per_prompt"):
        _async(rollout={"dynamic_sampling": True, "n_samples_per_prompt": 1})
    with pytest.raises(ConfigError, match="services.rollout_workers"):
        _async(services={"rollout_workers": 0})


def test_cpu_async_config_is_cpu_default_in_async_mode():
    """The same model, numerics (bf16 matmuls where native), data and warm start: both start from one cached
    policy, and a run moves between the modes by its mode and staleness settings."""
    fast, slow = load_config("configs/cpu-async.yaml"), load_config("configs/cpu-default.yaml")
    assert fast.mode == "async" and fast.rollout.max_staleness == 1
    assert slow.mode == "colocate" and slow.rollout.max_staleness == 0
    assert fast.model == slow.model and fast.model.matmul_dtype == "auto"
    assert fast.data == slow.data and fast.rollout.temperature == slow.rollout.temperature
    assert fast.warm_start == slow.warm_start and fast.train.total_steps == slow.train.total_steps


def test_role_config_loads_from_yaml_json_file_or_json_text(tmp_path):
    import json

    from relax_core.config import config_to_dict

    cfg = load_config("configs/cpu-async.yaml")
    text = json.dumps(config_to_dict(cfg))
    (tmp_path / "c.json").write_text(text)
    assert load_run_config(text) == cfg
    assert load_run_config(str(tmp_path / "c.json")) == cfg
    assert load_run_config("configs/cpu-async.yaml") == cfg


def test_core_share_lends_idle_cores_to_the_elastic_role(tmp_path):
    trainer = CoreShare(str(tmp_path), 2, "trainer-0")
    rollout = CoreShare(str(tmp_path), 2, "rollout-0")
    assert trainer.free() == 2
    with rollout.busy(1):
        assert trainer.free() == 1
        with CoreShare(str(tmp_path), 2, "rollout-1").busy(1):
            assert trainer.free() == 1  # never below one: the trainer itself still runs
    assert trainer.free() == 2


def test_an_elastic_trainer_takes_cores_freed_in_the_middle_of_a_step(tmp_path):
    """A rollout engine busy during the trainer's forward and done before its backward: the
    trainer's layers compute the forward on the one free core and the backward on both."""
    import torch

    from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
    from relax_core.roles.cores import check_cores_per_layer

    tok = build_char_tokenizer()
    model = build_tiny_qwen3(
        load_config("configs/cpu-default.yaml").model, len(tok), seed=0
    ).float()
    trainer = CoreShare(str(tmp_path), 2, "trainer-0")
    rollout = CoreShare(str(tmp_path), 2, "rollout-0")
    seen: list[tuple[str, int]] = []

    def take() -> None:
        torch.set_num_threads(trainer.free())

    def record(phase):
        return lambda *_: seen.append((phase, torch.get_num_threads()))

    assert check_cores_per_layer(model, take) == 2
    for layer in model.model.layers:  # registered after the core checks: they see the result
        layer.register_forward_pre_hook(record("forward"))
        layer.register_full_backward_pre_hook(record("backward"))
    threads = torch.get_num_threads()
    try:
        with rollout.busy(1):
            out = model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
        out.float().pow(2).mean().backward()
    finally:
        torch.set_num_threads(threads)
    assert seen == [("forward", 1)] * 2 + [("backward", 2)] * 2


def test_core_share_env_is_checked(monkeypatch):
    monkeypatch.setenv("RELAX_CORE_SHARE", "no-cores-given")
    with pytest.raises(ValueError, match="RELAX_CORE_SHARE"):
        CoreShare.from_env("trainer-0")
    monkeypatch.delenv("RELAX_CORE_SHARE")
    assert CoreShare.from_env("trainer-0") is None
