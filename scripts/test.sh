#!/usr/bin/env bash
# The test command (README): everything except GPU-only tests, with temp files kept in one place.
# Two pytest-xdist workers, each taking whole test files (so a module's servers start once): most
# integration tests wait on subprocesses and servers, and the runs tests start use one torch thread.
# RELAX_TEST_WORKERS=0 runs everything in this one process (a debugger, -x, -s).
set -euo pipefail
cd "$(dirname "$0")/.."
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TMPDIR="${TMPDIR:-$(mktemp -d)}"
exec python3 -m pytest -m "not gpu" -q --durations=15 -n "${RELAX_TEST_WORKERS:-2}" --dist loadfile "$@"
