#!/bin/sh
# The rollout pod's SGLang sidecar. The rollout service (the pod's primary container) writes the
# starting policy into the shared volume and then READY; starting the server earlier would load a
# half-written model. Arguments are more launch flags: the pod passes the ones the run's config
# decides (--tp-size, --mem-fraction-static, --enable-return-routed-experts, sglang.extra_args).
# The server listens on the pod's address, since the trainer in another pod drives its weight
# updates, so it must have an API key ($RELAX_SGLANG_API_KEY, from the run's Kubernetes secret):
# SGLang then refuses every request but /health* without it. Only a loopback server may go
# without one.
set -eu
model="${RELAX_MODEL_DIR:?RELAX_MODEL_DIR must name the shared policy directory}"
host="${SGLANG_HOST:-0.0.0.0}"
port="${SGLANG_PORT:-30000}"
poll="${RELAX_POLL_S:-2}"
key="${RELAX_SGLANG_API_KEY:-}"
case "$host" in
    127.0.0.1 | localhost | ::1) ;;
    *)
        if [ -z "$key" ]; then
            echo "RELAX_SGLANG_API_KEY is empty: a server on $host would take weight updates" \
                "from anyone who reaches the pod; set it (the run's secret) or SGLANG_HOST=127.0.0.1" >&2
            exit 2
        fi
        ;;
esac
until [ -f "$model/READY" ]; do
    sleep "$poll"
done
# VERSION (written with the policy) is the policy version the server reports until the trainer's
# first update, so the first completions are attributed to the right version.
version="$(cat "$model/VERSION" 2>/dev/null || echo default)"
if [ -n "$key" ]; then
    set -- --api-key "$key" "$@"
fi
exec python3 -m sglang.launch_server --model-path "$model" --host "$host" --port "$port" \
    --weight-version "$version" --skip-tokenizer-init "$@"
