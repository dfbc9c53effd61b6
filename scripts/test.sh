#!/usr/bin/env bash
# The test command (README): everything except GPU-only tests, with temp files kept in one place.
# Two pytest-xdist workers, each taking whole test files (so a module's servers start once), the
# slowest files first (tests/file_times.json, see scripts/durations.py): most
# integration tests wait on subprocesses and servers, and the runs tests start use one torch thread.
# RELAX_TEST_WORKERS=0 runs everything in this one process (a debugger, -x, -s).
# Ends with each test file's time and the slowest tests (scripts/durations.py). Its temp directory
# is removed after a green run and kept (its path printed) after a red one; RELAX_KEEP_TMP=1
# keeps it always.
set -uo pipefail
cd "$(dirname "$0")/.."
export MLFLOW_DISABLE_TELEMETRY=true HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
started=$SECONDS
work="$(mktemp -d)"
export TMPDIR="$work"
workers="${RELAX_TEST_WORKERS:-2}"
dist=()
if [ "$workers" != "0" ]; then dist=(-n "$workers" --dist loadfile --no-loadscope-reorder); fi
python3 -m pytest -m "not gpu" -q --durations=25 "${dist[@]}" \
  --junitxml="$work/junit.xml" -o junit_family=xunit1 "$@"
status=$?
if [ -s "$work/junit.xml" ]; then
  python3 scripts/durations.py "$work/junit.xml" --elapsed "$((SECONDS - started))"
fi
if [ "$status" -ne 0 ] || [ -n "${RELAX_KEEP_TMP:-}" ]; then
  echo "temp files (pod logs, run dirs) kept in $work"
else
  rm -rf "$work"
fi
exit "$status"
