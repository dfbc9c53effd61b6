#!/bin/sh
# The rollout pod's SGLang sidecar. The rollout service (the pod's primary container) writes the
# starting policy into the shared volume and then READY; starting the server earlier would load a
# half-written model. The server listens on loopback only: nothing outside the pod drives it.
set -eu
model="${RELAX_MODEL_DIR:?RELAX_MODEL_DIR must name the shared policy directory}"
port="${SGLANG_PORT:-30000}"
tp="${SGLANG_TP:-1}"
poll="${RELAX_POLL_S:-2}"
until [ -f "$model/READY" ]; do
    sleep "$poll"
done
# VERSION (written with the policy) is the policy version the server reports until the trainer's
# first update, so the first completions are attributed to the right version.
version="$(cat "$model/VERSION" 2>/dev/null || echo default)"
# shellcheck disable=SC2086 # SGLANG_EXTRA_ARGS is a list of arguments
exec python3 -m sglang.launch_server --model-path "$model" --host 127.0.0.1 --port "$port" \
    --tp-size "$tp" --weight-version "$version" --skip-tokenizer-init ${SGLANG_EXTRA_ARGS:-}
