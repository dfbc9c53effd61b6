"""The torch engine, the frozen scorers and the torch trainer on a GPU: models go to the device
their process was placed on, and a bf16 colocate run trains on float32 master weights there.

Runs on any CUDA machine with this repo installed (no SGLang, no megatron-core)."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from relax_core.config import ModelConfig
from relax_core.models.policy import on_accelerator
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.queue.schema import rows_to_table
from relax_core.roles.reference import add_ref_logprobs
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.backend import MASTER_WEIGHTS_FILE
from relax_core.train.checkpoint import find_resume_checkpoint

pytestmark = pytest.mark.gpu

SHAPE = ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
)


def test_engine_and_reference_score_on_the_gpu_what_they_score_on_the_cpu():
    tok = build_char_tokenizer()
    cpu_model = build_tiny_qwen3(SHAPE, len(tok), seed=0).eval()
    gpu_model = on_accelerator(copy.deepcopy(cpu_model))
    assert next(gpu_model.parameters()).is_cuda
    engine = TorchEngine(gpu_model, tok.eos_token_id, tok.pad_token_id, seed=1)
    prompts = [tok(f"{a}*{a}=", add_special_tokens=False)["input_ids"] for a in range(6)]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=8))
    table = rows_to_table(
        [
            {
                "uid": f"u{i}",
                "group_id": "g",
                "prompt_ids": list(p),
                "response_ids": o.response_ids,
                "loss_mask": [1] * len(o.response_ids),
            }
            for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
        ]
    )
    on_gpu = add_ref_logprobs(gpu_model, table, tok.pad_token_id, 4096, 1.0)
    on_cpu = add_ref_logprobs(cpu_model, table, tok.pad_token_id, 4096, 1.0)
    for o, g, c in zip(
        outs,
        on_gpu.column("ref_logprobs").to_pylist(),
        on_cpu.column("ref_logprobs").to_pylist(),
        strict=True,
    ):
        assert g == pytest.approx(c, abs=2e-3)
        assert g == pytest.approx(o.logprobs, abs=2e-3)  # the engine sampled what it scores


@pytest.mark.integration
@pytest.mark.slow
def test_a_bf16_colocate_run_trains_on_the_gpu_with_master_weights(small_config, workdir):
    pytest.importorskip("mlflow", reason="a run needs the full runtime (pip install -e .)")
    cfg = small_config(
        "gpu.yaml",
        run_name="g",
        model={"dtype": "bfloat16"},
        algorithm={"entropy_coef": 0.01, "kl_coef": 0.01},
        train={"total_steps": 4, "checkpoint_every": 2, "torch_threads": 0},
    )
    out = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ckpt = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "g")
    policy = load_file(os.path.join(ckpt, "model.safetensors"))
    master = load_file(os.path.join(ckpt, MASTER_WEIGHTS_FILE))
    assert {t.dtype for t in policy.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    for name, weight in master.items():
        assert torch.equal(policy[name], weight.to(torch.bfloat16)), name


@pytest.mark.integration
@pytest.mark.slow
def test_a_bf16_lora_colocate_run_trains_float32_adapters_on_the_gpu(small_config, workdir):
    pytest.importorskip("mlflow", reason="a run needs the full runtime (pip install -e .)")
    cfg = small_config(
        "lora.yaml",
        run_name="l",
        model={"dtype": "bfloat16"},
        # The KL anchor is the policy itself with its adapters off, on the GPU.
        algorithm={"entropy_coef": 0.01, "kl_coef": 0.01},
        train={
            "total_steps": 4,
            "checkpoint_every": 2,
            "torch_threads": 0,
            "lr": 5e-3,
            "lora": {"rank": 4},
        },
    )
    out = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ckpt = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "l")
    base = load_file(os.path.join(ckpt, "model.safetensors"))
    adapter = load_file(os.path.join(ckpt, "adapter", "adapter_model.safetensors"))
    assert {t.dtype for t in base.values()} == {torch.bfloat16}
    assert {t.dtype for t in adapter.values()} == {torch.float32}
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)
    assert not os.path.exists(os.path.join(ckpt, MASTER_WEIGHTS_FILE))  # the base never trains
