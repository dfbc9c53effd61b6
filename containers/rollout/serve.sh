#!/bin/sh
# The rollout pod's SGLang sidecar. The rollout service (the pod's primary container) writes the
# starting policy into the shared volume and then READY; starting the server earlier would load a
# half-written model. Arguments are more launch flags: the pod passes the ones the run's config
# decides (--tp-size, --mem-fraction-static, --enable-return-routed-experts, sglang.extra_args).
# The server listens on the pod's address, since the trainer in another pod drives its weight
# updates, so it must have an API key ($RELAX_SGLANG_API_KEY, from the run's Kubernetes secret):
# SGLang then refuses every request but /health* without it. Only a loopback server may go
# without one.
#
# The server ends with the run. Kubernetes ends a pod only when all of its containers have
# exited, and Flyte does not delete a finished pod by default, so a server left running would
# hold the pod's GPUs long after its run. The primary (relax_core/rollout/sidecar.py) writes, in
# the directory above the policy (a rewritten policy replaces the policy directory whole):
#   DONE       when it exits (a return, an exception, SIGTERM): the server is stopped, exit 0;
#   HEARTBEAT  touched every few seconds while it lives: silent for $RELAX_PRIMARY_STALE_S, the
#              primary died without a word (OOM kill, SIGKILL): the server is stopped, exit 0;
#              before READY that is a failure (exit 3), as is no heartbeat at all within
#              $RELAX_PRIMARY_START_S.
# Stopping is SIGTERM to the server's process group, SIGKILL after $RELAX_SIDECAR_GRACE_S (the
# pod's terminationGracePeriodSeconds is longer: tasks/pods.py). A server that exits by itself
# ends this script with its status; SIGTERM here (the pod deleted) stops the server first.
# POSIX sh, plus `stat -c %Y`, `date +%s` and `setsid` (coreutils and util-linux, or busybox).
set -eu
model="${RELAX_MODEL_DIR:?RELAX_MODEL_DIR must name the shared policy directory}"
host="${SGLANG_HOST:-0.0.0.0}"
port="${SGLANG_PORT:-30000}"
poll="${RELAX_POLL_S:-2}"
key="${RELAX_SGLANG_API_KEY:-}"
grace="${RELAX_SIDECAR_GRACE_S:-30}"
stale="${RELAX_PRIMARY_STALE_S:-120}"
first_beat="${RELAX_PRIMARY_START_S:-1800}"
shared="$(dirname "$model")"
done_file="$shared/DONE"
beat_file="$shared/HEARTBEAT"
for seconds in "RELAX_SIDECAR_GRACE_S=$grace" "RELAX_PRIMARY_STALE_S=$stale" \
    "RELAX_PRIMARY_START_S=$first_beat"; do
    case "${seconds#*=}" in
        '' | *[!0-9]*)
            echo "${seconds%%=*} must be whole seconds, not '${seconds#*=}'" >&2
            exit 2
            ;;
    esac
done
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
started="$(date +%s)"
server=""
nap=""

say() {
    echo "serve.sh: $*" >&2
}

# Succeeds, with $why set, when the primary is gone: DONE written, or its heartbeat silent.
primary_gone() {
    if [ -f "$done_file" ]; then
        why="the rollout service finished ($done_file)"
        return 0
    fi
    now="$(date +%s)"
    if [ -f "$beat_file" ]; then
        last="$(stat -c %Y "$beat_file" 2>/dev/null || echo "$now")"
        if [ $((now - last)) -gt "$stale" ]; then
            why="the rollout service's heartbeat ($beat_file) is $((now - last)) s old (> $stale s)"
            return 0
        fi
    elif [ $((now - started)) -gt "$first_beat" ]; then
        why="no heartbeat from the rollout service ($beat_file) in $first_beat s"
        return 0
    fi
    return 1
}

# Sleep one poll interval; a trapped signal interrupts `wait`, where it would not a plain sleep.
pause() {
    sleep "$poll" &
    nap=$!
    wait "$nap" || true
    nap=""
}

# SIGTERM to the server's process group (SGLang's scheduler and detokenizer processes with it);
# once the server has exited, or after the grace, SIGKILL to whatever is left of the group.
stop_server() {
    [ -n "$server" ] || return 0
    say "$1: stopping the SGLang server (pid $server)"
    kill -TERM "-$server" 2>/dev/null || kill -TERM "$server" 2>/dev/null || true
    since="$(date +%s)"
    while kill -0 "$server" 2>/dev/null; do
        if [ $(($(date +%s) - since)) -gt "$grace" ]; then
            say "the server outlived the ${grace} s grace: SIGKILL"
            break
        fi
        pause
    done
    kill -KILL "-$server" 2>/dev/null || kill -KILL "$server" 2>/dev/null || true
    wait "$server" 2>/dev/null || true
}

on_signal() {
    trap '' TERM INT USR1
    for pid in $nap $watcher; do
        kill "$pid" 2>/dev/null || true
    done
    stop_server "$1"
    exit "$2"
}
watcher=""
trap 'on_signal SIGTERM 143' TERM
trap 'on_signal SIGINT 130' INT

until [ -f "$model/READY" ]; do
    if primary_gone; then
        say "$why before the policy was published; not starting the server"
        [ -f "$done_file" ] && exit 0
        exit 3
    fi
    pause
done
# VERSION (written with the policy) is the policy version the server reports until the trainer's
# first update, so the first completions are attributed to the right version.
version="$(cat "$model/VERSION" 2>/dev/null || echo default)"
if [ -n "$key" ]; then
    set -- --api-key "$key" "$@"
fi
launch=""
command -v setsid >/dev/null 2>&1 && launch="setsid"
# The server in a session of its own (a background job here is no process group leader, so
# setsid does not fork: $! is the server), so one signal reaches all of its processes.
$launch python3 -m sglang.launch_server --model-path "$model" --host "$host" --port "$port" \
    --weight-version "$version" --skip-tokenizer-init "$@" &
server=$!
# This shell waits on the server, so its exit ends the sidecar at once; a subshell watches the
# primary and signals this shell (USR1) when it is gone.
trap 'on_signal "$why" 0' USR1
why="the rollout service is gone"
# The watcher also ends when the server is gone: the TERM this shell sends it then can land before
# the subshell has set its trap, and dash drops a signal caught in that window.
(
    nap=""
    trap 'kill $nap 2>/dev/null || true; exit 0' TERM
    until primary_gone; do
        kill -0 "$server" 2>/dev/null || exit 0
        pause
    done
    say "$why"
    kill -USR1 $$
) &
watcher=$!
status=0
wait "$server" || status=$?
trap '' USR1
kill "$watcher" 2>/dev/null || true
wait "$watcher" 2>/dev/null || true
kill -KILL "-$server" 2>/dev/null || true # what it left of its processes
say "the SGLang server exited with status $status"
exit "$status"
