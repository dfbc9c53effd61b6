#!/usr/bin/env bash
# The test command (README): everything except GPU-only tests, with temp files kept in one place.
set -euo pipefail
cd "$(dirname "$0")/.."
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TMPDIR="${TMPDIR:-$(mktemp -d)}"
exec python3 -m pytest -m "not gpu" -q --durations=15 "$@"
