#!/usr/bin/env bash
# GPU bring-up kit, one command on a bare GPU machine:
#
#   scripts/gpu_check.sh [--size 0.6b|1.7b] [bench/gpu_check.py options]
#
# Needs a Python (python3, or $PYTHON) with CUDA torch and transformers. What else the GPU
# path imports and that machine lacks travels as wheels in .whl/ (megatron-core for Python
# 3.12: see docs/gpus.md, "GPU bring-up kit"); they are installed into /tmp/relax-site, not
# into that Python. Runs bench/gpu_check.py (peak, torch, fsdp, engine, megatron, nccl, plan,
# sglang_ipc), the gpu-marked tests when GPU_CHECK_TESTS=1, then whole runs of shipped configs on
# the GPU (GPU_CHECK_RUNS, default configs/cpu-default.yaml; empty skips them). Output also goes
# to $GPU_CHECK_OUT (default gpu-check/) as gpu_check.log, gpu_check.json (rewritten after each
# part), gpu_tests.log and run_<config>.log.
#
# Every step is bounded, so the default run fits a short GPU loan: at most 6 minutes with the
# kill grace (tests/unit/test_gpu_check.py sums the defaults). Seconds, an empty value unbounds:
#   GPU_CHECK_WHEELS_TIMEOUT 15   installing .whl/
#   GPU_CHECK_PROBE_TIMEOUT  15   the versions and GPUs printed first
#   GPU_CHECK_PARTS_TIMEOUT  225  bench/gpu_check.py, whose parts have their own bounds (220 s)
#   GPU_CHECK_TESTS_TIMEOUT  240  the gpu-marked tests (off by default: GPU_CHECK_TESTS=1)
#   GPU_CHECK_RUN_TIMEOUT    95   each whole run
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${GPU_CHECK_OUT:-gpu-check}
mkdir -p "$OUT_DIR"

KILL_GRACE=2
bounded() {  # bounded SECONDS CMD...: CMD, killed after SECONDS (+ KILL_GRACE); '' = unbounded
  if [ -n "$1" ]; then timeout -k "$KILL_GRACE" "$1" "${@:2}"; else "${@:2}"; fi
}

if compgen -G ".whl/*.whl" >/dev/null; then
  bounded "${GPU_CHECK_WHEELS_TIMEOUT-15}" "$PY" -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/relax-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/relax-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

bounded "${GPU_CHECK_PROBE_TIMEOUT-15}" "$PY" - <<'PY'
import importlib, platform, torch
print(f"python {platform.python_version()}, torch {torch.__version__}, cuda {torch.version.cuda}, "
      f"GPUs {torch.cuda.device_count()}: {[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}")
for name in ("transformers", "safetensors", "pyarrow", "yaml", "fsspec", "megatron.core", "sglang"):
    try:
        mod = importlib.import_module(name)
        print(f"  {name} {getattr(mod, '__version__', '')}")
    except Exception as err:
        print(f"  {name}: missing ({type(err).__name__})")
PY

bounded "${GPU_CHECK_PARTS_TIMEOUT-225}" "$PY" -m bench.gpu_check \
  --json "$OUT_DIR/gpu_check.json" "$@" 2>&1 | tee "$OUT_DIR/gpu_check.log"
status=${PIPESTATUS[0]}

if [ "${GPU_CHECK_TESTS:-0}" = 1 ]; then
  bounded "${GPU_CHECK_TESTS_TIMEOUT-240}" "$PY" -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu -rs 2>&1 | tee "$OUT_DIR/gpu_tests.log"
  tests=${PIPESTATUS[0]}
  [ "$tests" = 0 ] || [ "$tests" = 5 ] || status=1  # 5: nothing collected
fi

# Whole runs as a user starts them (without Flyte, which the GPU image lacks), each in a fresh
# directory holding only the datasets, so nothing of an earlier run is resumed or reused.
for cfg in ${GPU_CHECK_RUNS-configs/cpu-default.yaml}; do
  name=$(basename "$cfg" .yaml)
  work=$(mktemp -d)
  cp -r datasets "$work/"
  path=$(realpath "$cfg")
  start=$EPOCHREALTIME
  (cd "$work" && bounded "${GPU_CHECK_RUN_TIMEOUT-95}" "$PY" -m relax_core.entrypoints.run \
    --cfg "$path") 2>&1 | tee "$OUT_DIR/run_$name.log"
  rc=${PIPESTATUS[0]}
  wall=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $start }")
  echo "run $cfg: exit $rc, $wall s wall" | tee -a "$OUT_DIR/run_$name.log"
  [ "$rc" = 0 ] || status=1
done
exit "$status"
