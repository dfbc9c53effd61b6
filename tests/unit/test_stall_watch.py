"""A role whose main loop stops coming round stops touching its liveness file, so the local
supervisor handles it as silent, even when the hang leaves the interpreter's lock free and the
liveness thread could go on beating; the thread stacks go to the role's log first."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from relax_core.config import ConfigError, load_config, replace
from relax_core.roles import service
from tests.runs import wait_until

EVERY_S = 0.02
STALL_S = 0.4
DEADLINE_S = 20.0


def _mtime(path) -> int:
    return os.stat(path).st_mtime_ns


def _until(condition, what: str) -> None:
    wait_until(condition, what, DEADLINE_S, EVERY_S)


def _touched_after(path, seconds: float) -> None:
    """Wait until the liveness file is touched `seconds` or more after now: the thread went on
    beating through that long (a wall-clock mtime, as the supervisor reads it)."""
    after = time.time_ns() + int(seconds * 1e9)
    _until(lambda: _mtime(path) >= after, f"a touch of {path.name} {seconds} s from now")


def _touched_again_within(path, seconds: float) -> bool:
    before = _mtime(path)
    time.sleep(seconds)
    return _mtime(path) != before


@pytest.fixture
def liveness(tmp_path, monkeypatch):
    path = tmp_path / "liveness"
    monkeypatch.setenv(service.LIVENESS_ENV, str(path))
    monkeypatch.setattr(service, "_last_progress", None)  # a process whose loop has not begun
    return path


def test_a_main_loop_hung_outside_the_lock_loses_its_liveness_until_it_comes_round(
    liveness, caplog, capfd
):
    hung, answered = threading.Event(), threading.Event()

    def main_loop() -> None:  # one round, then a wait that releases the lock, as a dead peer's
        service.mark_progress()
        hung.wait()
        while not answered.wait(EVERY_S):  # the peer answered: it comes round again, and on
            service.mark_progress()

    with caplog.at_level(logging.WARNING, logger="relax_core.roles.service"):
        done = service.beat_locally("rollout-0", EVERY_S, STALL_S)
        loop = threading.Thread(target=main_loop, name="role-main-loop", daemon=True)
        try:
            # Before the loop's first round (start-up) only silence counts: it keeps beating.
            _until(liveness.exists, "the first touch")
            _touched_after(liveness, 2 * STALL_S)
            loop.start()
            _until(lambda: "has not come round" in caplog.text, "the stall report")
            assert not _touched_again_within(liveness, 10 * EVERY_S)
            stacks = ""

            def dumped() -> bool:  # every thread's stack follows the report, on stderr
                nonlocal stacks
                stacks += capfd.readouterr().err
                return "role-main-loop" in stacks or "main_loop" in stacks

            _until(dumped, "the main loop's stack on stderr")
            # The loop comes round again before the supervisor acted: liveness resumes.
            hung.set()
            _touched_after(liveness, 0.0)
            assert "came round again" in caplog.text
        finally:
            done.set()
            answered.set()
            hung.set()
    messages = [r.getMessage() for r in caplog.records]
    resumed = next(i for i, m in enumerate(messages) if "came round again" in m)
    stalls = [r for r in caplog.records[:resumed] if "has not come round" in r.getMessage()]
    assert len(stalls) == 1 and stalls[0].levelno == logging.ERROR  # said once, not each beat
    assert "rollout-0" in stalls[0].getMessage()


def _beats_on(liveness, name: str, stall_s: float, quiet_s: float) -> None:
    """`name`'s liveness thread touches the file `quiet_s` from now and later."""
    done = service.beat_locally(name, EVERY_S, stall_s)
    try:
        _until(liveness.exists, "the first touch")
        _touched_after(liveness, quiet_s)
    finally:
        done.set()


def test_without_a_stall_timeout_a_quiet_loop_keeps_beating(liveness):
    service.mark_progress()
    _beats_on(liveness, "trainer-0", 0.0, 2 * STALL_S)


def test_a_loop_that_comes_round_keeps_beating(liveness):
    stop = threading.Event()

    def busy_loop() -> None:
        while not stop.is_set():
            service.mark_progress()
            time.sleep(STALL_S / 8)

    threading.Thread(target=busy_loop, daemon=True).start()
    try:
        _beats_on(liveness, "advantages-0", STALL_S, 3 * STALL_S)
    finally:
        stop.set()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1.0, "services.stall_timeout_s: must be >= 0"),
        (300.0, "must exceed services.heartbeat_s (5.0) and storage.outage_limit_s (600.0)"),
    ],
)
def test_a_stall_timeout_that_would_fire_inside_an_outage_is_refused(value, message):
    cfg = load_config("configs/cpu-async.yaml")
    with pytest.raises(ConfigError) as err:
        replace(cfg, services={"stall_timeout_s": value})
    assert message in str(err.value)
    assert replace(cfg, services={"stall_timeout_s": 0.0}).services.stall_timeout_s == 0.0


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    """`kill -USR1` on a stuck role shows where each thread waits, without ending it."""
    child = "\n".join(
        [
            "import sys, threading",
            "from relax_core.roles.stacks import dump_stacks_on_signal",
            "dump_stacks_on_signal()",
            "def waiting_for_a_dead_peer():",
            "    threading.Event().wait()",
            "threading.Thread(target=waiting_for_a_dead_peer, daemon=True).start()",
            "print('ready', flush=True)",
            "for line in sys.stdin:",
            "    print('still here', flush=True)",
        ]
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGUSR1)
        stacks = ""
        while "in <module>" not in stacks:  # the main thread's stack comes last
            line = proc.stderr.readline()
            assert line, f"stderr ended: {stacks}"
            stacks += line
        assert "waiting_for_a_dead_peer" in stacks
        proc.stdin.write("go on\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "still here"
    finally:
        proc.kill()
        proc.wait()
