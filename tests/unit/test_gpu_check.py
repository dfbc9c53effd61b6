"""The GPU bring-up kit (bench/gpu_check.py) stays runnable between GPU sessions: its parts run
the same code on the CPU with a tiny Qwen3 shape, and its FLOP count is the hand count."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest

from bench.gpu_check import BOUNDS, DEFAULT_PARTS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flop_count_of_a_qwen3_forward_by_hand():
    from bench.gpu_parts import SHAPES, forward_flops

    s = SHAPES["tiny"]  # hidden 64, 4 heads x 16, 2 kv heads, mlp 128, 2 layers, vocab 512
    # per token per layer: q 64x64 + k,v 64x32 each + o 64x64 + mlp 3x64x128 = 36864 MACs
    # decoder 2 x 36864 x 10 tokens x 2 layers; attention 2 x 10^2 x 64 x 2 layers;
    # LM head 2 x 64 x 512 x 4 scored tokens
    assert forward_flops(s, seq=10, response=4) == 2 * 36864 * 10 * 2 + 2 * 100 * 64 * 2 + (
        2 * 64 * 512 * 4
    )


@pytest.mark.slow
def test_the_kit_runs_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    args = "--size tiny --steps 2 --seqs 4 --micro 2 --prompt 8 --response 8"
    args += " --gen-batch 4 --gen-tokens 8 --parts peak,torch,fsdp,engine,nccl,plan"
    # The plan part at the tiny shape: a micro-batch of one sequence, and one the plan refuses
    # on the card it plans for (nothing of it runs).
    args += " --plan-size tiny --plan-tokens 16,4000000000"
    # The GPU bounds are a loan's; a loaded 2-core box needs more.
    generous = ",".join(f"{name}=300" for name in BOUNDS)
    args += f" --bounds {generous}"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", *args.split(), "--json", str(out)],
        cwd=REPO,
        env={**os.environ, "GPU_CHECK_DEVICE": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("headline: gpu_check_torch_mfu = ")
    written = json.loads(out.read_text())
    results = written["results"]
    assert {name: r["status"] for name, r in results.items()} == dict.fromkeys(results, "ok")
    assert written["bounds_s"] == dict.fromkeys(BOUNDS, 300.0)
    for backend in ("torch", "fsdp"):
        r = results[backend]
        assert r["weights_dtype"] == "torch.bfloat16"  # what engines receive
        assert r["bf16_weights_changed"] > 0.01  # lr 1e-6 reaches them through the master
        # On the CPU the denominator is a 256^3 bf16 matmul timed beside whatever else runs,
        # not a peak: a step timed in a quieter moment reads above 1 (1.17 seen). On a GPU the
        # kit fails a part whose MFU is not below 1; here the figure must only come out.
        assert math.isfinite(r["mfu"]) and r["mfu"] > 0 and r["tokens_per_s"] > 0
    assert results["engine"]["tokens_per_s"] > 0
    assert results["nccl"]["receiver"]["versions_received"] == 4  # warm-up + 3 timed pushes
    cases = {(c["tokens"], c["checkpointing"]): c for c in results["plan"]["cases"]}
    assert set(cases) == {(n, ck) for n in (16, 4000000000) for ck in (False, True)}
    for ckpt in (False, True):
        assert cases[16, ckpt]["status"] == "ok"
        refused = cases[4000000000, ckpt]
        assert refused["status"] == "skipped" and "the plan needs" in refused["why"]
        assert refused["plan_bytes"] > 79 * 2**30 > cases[16, ckpt]["plan_bytes"]
    assert cases[16, True]["plan_bytes"] < cases[16, False]["plan_bytes"]  # checkpointing


def test_the_default_run_is_bounded_within_a_short_gpu_loan():
    with open(os.path.join(REPO, "scripts", "gpu_check.sh")) as f:
        script = f.read()
    defaults = dict(re.findall(r"\$\{GPU_CHECK_(\w+)_TIMEOUT-(\d+)\}", script))
    grace = int(re.search(r"^KILL_GRACE=(\d+)$", script, re.M).group(1))
    runs = re.search(r"\$\{GPU_CHECK_RUNS-([^}]*)\}", script).group(1).split()
    assert runs == ["configs/cpu-default.yaml"]
    assert '"${GPU_CHECK_TESTS:-0}" = 1' in script  # the gpu-marked tests only when asked
    steps = [int(defaults[k]) for k in ("WHEELS", "PROBE", "PARTS")] + [int(defaults["RUN"])]
    # 15 + 15 + 225 + 95 s, each with 2 s of kill grace: 358 s, under the 6 minutes a loan
    # leaves after the machine's start
    assert sum(steps) + grace * len(steps) <= 6 * 60
    # Every default part has its own bound, and they end before the script's bound on them all.
    assert DEFAULT_PARTS.split(",") == list(BOUNDS)
    assert sum(BOUNDS.values()) <= int(defaults["PARTS"])


def test_a_part_past_its_bound_is_killed_and_the_json_keeps_what_was_written(tmp_path):
    out = tmp_path / "gpu_check.json"
    argv = [sys.executable, "-m", "bench.gpu_check", "--parts", "plan", "--plan-size", "tiny"]
    argv += ["--bounds", "plan=0.5", "--json", str(out)]
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu"}
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "parts failed: plan" in proc.stdout
    written = json.loads(out.read_text())
    assert written["results"]["plan"] == {"status": "timed_out", "bound_s": 0.5}
    assert not (tmp_path / "gpu_check.json.tmp").exists()
