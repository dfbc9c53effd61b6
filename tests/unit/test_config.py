"""Config loading: every shipped YAML parses; bad input gives one error naming field and allowed values."""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

from relax_core.config import ConfigError, RunConfig, config_from_dict, load_config, replace

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))))
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert cfg.run_name


def test_cpu_default_is_colocate_on_the_tiny_model():
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    assert cfg.mode == "colocate" and cfg.rollout.max_staleness == 0
    assert cfg.model.kind == "tiny-qwen3"
    assert cfg.warm_start.steps > 0


def test_unknown_field_names_its_path_and_the_allowed_fields():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"train": {"total_stepz": 3}})
    msg = str(err.value)
    assert "train.total_stepz: unknown field" in msg
    assert "total_steps" in msg  # the allowed names are listed


def test_wrong_types_are_all_reported_together():
    with pytest.raises(ConfigError) as err:
        config_from_dict(
            {"train": {"lr": "fast"}, "rollout": {"max_new_tokens": 2.5}, "seed": True}
        )
    msg = str(err.value)
    assert "train.lr: expected a number, got 'fast'" in msg
    assert "rollout.max_new_tokens: expected an integer, got 2.5" in msg
    assert "seed: expected an integer, got True" in msg


def test_a_learning_rate_in_exponent_notation_is_a_number_in_yaml(tmp_path):
    # PyYAML (YAML 1.1) and so flytekit's reading of --cfg take `1e-6` for text.
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: 5e-6\nalgorithm:\n  kl_coef: 1E-3\n")
    cfg = load_config(str(path))
    assert cfg.train.lr == 5e-6 and cfg.algorithm.kl_coef == 1e-3
    with pytest.raises(ConfigError, match="train.lr: expected a number, got '5e-6x'"):
        config_from_dict({"train": {"lr": "5e-6x"}})


def test_invalid_choice_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"algorithm.kl_kind: 'k9' is not one of k1, k2, k3"):
        config_from_dict({"algorithm": {"kl_kind": "k9"}})


def test_colocate_refuses_staleness():
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        config_from_dict({"rollout": {"max_staleness": 2}})


def test_a_deterministic_async_run_needs_staleness_zero_and_one_rollout_worker():
    on_policy = {"mode": "async", "train": {"deterministic": True}}
    assert config_from_dict({**on_policy, "rollout": {"max_staleness": 0}}).train.deterministic
    for bad in ({"rollout": {"max_staleness": 1}}, {"services": {"rollout_workers": 2}}):
        with pytest.raises(ConfigError, match="train.deterministic: an async run repeats only"):
            config_from_dict({**on_policy, **bad})


def test_ints_are_accepted_for_floats_and_section_can_be_replaced():
    cfg = config_from_dict({"train": {"lr": 1}})
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert replace(cfg, train={"total_steps": 7}).train.total_steps == 7


def test_from_json_is_strict_because_pyflyte_parses_cfg_with_it():
    with pytest.raises(ConfigError, match="model.colour: unknown field"):
        RunConfig.from_json(json.dumps({"model": {"colour": "red"}}))
    assert RunConfig.from_json(json.dumps({"seed": 3})).seed == 3


def test_missing_config_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_config_module_imports_neither_torch_nor_flytekit():
    import subprocess
    import sys

    code = "import sys, relax_core.config; print('torch' in sys.modules, 'flytekit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.stdout.split() == ["False", "False"], out.stderr


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"algorithm": {"loss": "gspo"}}, "GSPO clips a sequence-level ratio"),
        ({"algorithm": {"loss": "sapo", "dual_clip": 3.0}}, "SAPO has no clip to dualize"),
        ({"algorithm": {"dual_clip": 0.5}}, "algorithm.dual_clip: must be 0 (off) or > 1"),
        ({"algorithm": {"loss": "decoupled_ppo", "is_mode": "tis"}}, "apply it twice"),
        ({"algorithm": {"is_mode": "clip"}}, "algorithm.is_mode"),
        ({"algorithm": {"is_cap": 1.0}}, "algorithm.is_cap: must be > 1"),
        ({"algorithm": {"sapo_tau_neg": 0.0}}, "algorithm.sapo_tau_neg: must be > 0"),
        ({"algorithm": {"distill_coef": 0.5}}, "algorithm.teacher: required"),
        ({"algorithm": {"teacher": "ckpt"}}, "a teacher is set but distill_coef is 0"),
        ({"algorithm": {"advantage": "none"}}, "'none' leaves nothing to learn"),
        ({"algorithm": {"loss_agg": "sum"}}, "dr_grpo"),
        (
            {"rollout": {"dynamic_sampling": True, "n_samples_per_prompt": 1}},
            "groups of one never vary",
        ),
        ({"rollout": {"max_sampling_rounds": 0}}, "rollout.max_sampling_rounds: must be > 0"),
        ({"reward": {"overlong_buffer": 4}}, "below rollout.max_new_tokens (4)"),
        ({"reward": {"overlong_penalty": -1.0}}, "reward.overlong_penalty: must be >= 0"),
        ({"reward": {"name": "genrm", "judge_batch_size": 0}}, "reward.judge_batch_size"),
    ],
)
def test_algorithm_knobs_and_nonsense_combinations_are_refused(sections, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        replace(load_config(os.path.join(REPO, "configs", "cpu-default.yaml")), **sections)


def test_algorithm_suite_settings_that_make_sense_load():
    cfg = replace(
        load_config(os.path.join(REPO, "configs", "cpu-default.yaml")),
        algorithm={"loss": "gspo", "eps_clip": 3e-4, "eps_clip_high": 4e-4, "is_mode": "mis"},
        rollout={"dynamic_sampling": True},
        reward={"overlong_buffer": 1},
    )
    assert cfg.algorithm.loss == "gspo" and cfg.rollout.dynamic_sampling


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"rollout": {"engine": "tgi"}}, "rollout.engine: 'tgi' is not one of torch, sglang, vllm"),
        ({"tracking": {"registered_model": "my model"}}, "tracking.registered_model: 'my model'"),
        ({"tracking": {"registered_model": "a/b"}}, "letters, digits, '.', '_' or '-'"),
        (
            {"model": {"kind": "pretrained", "source": "models:/policy"}},
            "model.source: 'models:/policy' is not a registry reference",
        ),
    ],
)
def test_engine_and_registry_settings_are_checked(sections, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        replace(load_config(os.path.join(REPO, "configs", "cpu-default.yaml")), **sections)


def test_registry_references_in_every_form_load():
    base = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    for source in ("models:/relax/3", "models:/relax/latest", "models:/relax@champion"):
        cfg = replace(base, model={"kind": "pretrained", "source": source})
        assert cfg.model.source == source


@pytest.mark.parametrize(
    ("name", "kind", "source", "modalities", "gpus"),
    [
        (
            "qwen3-vl-4b-8xgpu",
            "qwen3-vl",
            "s3://my-bucket/models/Qwen3-VL-4B-Instruct",
            {"image", "video"},
            8,
        ),
        (
            "qwen3-omni-30b-a3b-16xgpu",
            "qwen3-omni",
            "s3://my-bucket/models/Qwen3-Omni-30B-A3B-Instruct",
            {"image", "video", "audio"},
            16,
        ),
    ],
)
def test_the_qwen_cluster_configs_name_their_model_media_and_gpus(
    name, kind, source, modalities, gpus
):
    from relax_core.config.checks import MODALITIES

    cfg = load_config(os.path.join(REPO, "configs", f"{name}.yaml"))
    assert (cfg.run_name, cfg.model.kind, cfg.model.source) == (name, kind, source)
    assert set(MODALITIES[cfg.model.kind]) == modalities
    assert cfg.mode == "async" and cfg.services.launch == "tasks"
    assert cfg.model.dtype == "bfloat16" and cfg.warm_start.steps == 0
    s = cfg.services
    assert s.trainer_gpus + s.rollout_workers * s.rollout_gpus == gpus


@pytest.mark.parametrize(
    ("model", "sections", "expected"),
    [
        ({"kind": "qwen3-vl"}, {}, "model.source: required when model.kind is 'qwen3-vl'"),
        (
            {"kind": "qwen2.5-omni", "source": "Qwen/Qwen2.5-Omni-7B"},
            {"warm_start": {"steps": 5}},
            "warm_start.steps: the warm start feeds media to tiny-omni policies only",
        ),
        (
            {"kind": "qwen4-vl", "source": "x"},
            {},
            "model.kind: 'qwen4-vl' is not one of tiny-qwen3, tiny-omni, pretrained, qwen2.5-vl, "
            "qwen3-vl, qwen2.5-omni, qwen3-omni",
        ),
        (
            {"kind": "qwen3-vl", "source": "Qwen/Qwen3-VL-4B-Instruct"},
            {"services": {"trainer_gpus": 0}},
            "services.trainer_gpus: must be > 0, got 0",
        ),
    ],
)
def test_qwen_model_settings_are_checked(model, sections, expected):
    base = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    with pytest.raises(ConfigError, match=re.escape(expected)):
        replace(base, **{"model": model, "warm_start": {"steps": 0}, **sections})


VLLM = os.path.join(REPO, "configs", "vllm-cpu.yaml")


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"vllm": {"pause_mode": "retract"}}, "vllm.pause_mode: 'retract' is not one of abort"),
        ({"model": {"num_heads": 12, "num_kv_heads": 6}}, "heads of width 16 (hidden_size 192"),
        ({"rollout": {"max_new_tokens": 512}}, "rollout.max_new_tokens: 512 leaves no room"),
        ({"vllm": {"kv_cache_gib": 0}}, "vllm.kv_cache_gib: a whole number of GiB >= 1"),
        ({"vllm": {"url": "localhost:8000"}}, "vllm.url: must start with http://"),
        (
            {"train": {"lora": {"rank": 8}}, "vllm": {"lora_dir": ""}},
            "vllm.lora_dir: required for a LoRA policy",
        ),
        ({"services": {"launch": "tasks"}}, "rollout.engine: 'vllm' runs with services.launch"),
        ({"services": {"actor_fwd": True}, "mode": "async"}, "services.actor_fwd: with rollout"),
    ],
)
def test_what_vllm_engines_cannot_do_yet_is_refused_before_launch(sections, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        replace(load_config(VLLM), **sections)


def test_the_vllm_configs_load():
    cpu = load_config(VLLM)
    assert cpu.rollout.engine == "vllm" and cpu.model.hidden_size // cpu.model.num_heads == 32
    gpu = load_config(os.path.join(REPO, "configs", "qwen3-4b-8xgpu-vllm.yaml"))
    assert gpu.rollout.engine == "vllm" and gpu.vllm.pause_mode == "keep"
