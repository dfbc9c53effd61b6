"""The rollout service's half of the sidecar's lifetime (tasks/pods.py, containers/rollout/serve.sh).

In the rollout pod the SGLang server runs in a container of its own, which Kubernetes does not
stop when the rollout service (the pod's primary) exits: the pod, and its GPUs, would stay until
someone deletes it. So the service tells the sidecar, through two files in the shared volume
beside the policy directory ($RELAX_MODEL_DIR), when to stop:

- `HEARTBEAT`, touched every `BEAT_S` from a daemon thread while the service lives: when it goes
  silent (the process OOM-killed or SIGKILLed, with no chance to say so) the sidecar stops;
- `DONE`, written when the service exits by any path: a return, an exception, SIGTERM.

They live beside the policy directory, not in it: `sglang_server.publish_policy` replaces that
directory whole. Without $RELAX_MODEL_DIR (no sidecar: a local run, a server of its own) nothing
is written.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

MODEL_DIR_ENV = "RELAX_MODEL_DIR"
HEARTBEAT = "HEARTBEAT"
DONE = "DONE"
BEAT_S = 5.0
"""How often the heartbeat is touched; serve.sh judges it stale after $RELAX_PRIMARY_STALE_S
(120 s by default), long enough for a thread held off the interpreter's lock for a while."""


def shared_dir(model_dir: str) -> str:
    """Where HEARTBEAT and DONE go: the directory above the policy's."""
    return os.path.dirname(os.path.normpath(model_dir))


def _touch(path: str) -> None:
    with open(path, "a"):
        pass
    os.utime(path)


def tell_sidecar(beat_s: float = BEAT_S) -> Callable[[], None]:
    """Start the heartbeat and write DONE on SIGTERM; returns what the caller runs when it
    leaves by a return or an exception (in a `finally`), which writes DONE. Does nothing when
    $RELAX_MODEL_DIR is unset."""
    model_dir = os.environ.get(MODEL_DIR_ENV)
    if not model_dir:
        return lambda: None
    where = shared_dir(model_dir)
    os.makedirs(where, exist_ok=True)
    beat, done = os.path.join(where, HEARTBEAT), os.path.join(where, DONE)
    stop = threading.Event()
    _touch(beat)

    def loop() -> None:
        failing = False
        while not stop.wait(beat_s):
            try:
                _touch(beat)
                failing = False
            except OSError as exc:  # said once; the sidecar sees the silence
                if not failing:
                    log.warning("sidecar heartbeat %s: %s", beat, exc)
                failing = True

    threading.Thread(target=loop, name="sidecar-heartbeat", daemon=True).start()
    restore = _done_on_sigterm(done)

    def finish() -> None:
        stop.set()
        restore()
        _write_done(done)

    return finish


def _write_done(path: str) -> None:
    try:
        _touch(path)
        log.info("told the SGLang sidecar that the rollout service is done (%s)", path)
    except OSError as exc:  # the heartbeat stops with the process: the sidecar stops later
        log.warning("could not write %s for the SGLang sidecar: %s", path, exc)


def _done_on_sigterm(done: str) -> Callable[[], None]:
    """Until the returned function is called, a SIGTERM that would end the process (no handler
    in place) writes `done` first. A handler already in place is left to decide: one that unwinds
    (SystemExit) reaches the caller's `finally`, one that lets the process go on means it is not
    done yet. On the main thread only (elsewhere handlers cannot be set; the heartbeat stops with
    the process)."""
    previous = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or previous not in (
        signal.SIG_DFL,
        None,
    ):
        return lambda: None

    def on_sigterm(signum: int, _frame: object) -> None:
        _write_done(done)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)  # ended by the signal, as without this handler

    signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

    return restore
