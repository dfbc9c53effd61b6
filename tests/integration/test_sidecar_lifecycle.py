"""The rollout pod's SGLang sidecar ends with its run (containers/rollout/serve.sh and
relax_core/rollout/sidecar.py): Kubernetes ends a pod only when all of its containers have, so a
server left running would hold the pod's GPUs after the run.

serve.sh runs for real, in a process group of its own as in its container, starting a stand-in
`sglang.launch_server` (written here: the server and a child process, as SGLang's scheduler, that
sleep until signalled; tests/integration/sglang_shim serves a torch policy, seconds to start). The
primary's half runs for real in a child process. A heartbeat gone silent is shown by ageing the
file, the state a killed primary leaves after $RELAX_PRIMARY_STALE_S, without waiting for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from relax_core.rollout.sglang_server import publish_policy
from relax_core.rollout.sidecar import tell_sidecar
from tasks.pods import POD_GRACE_S, SIDECAR, sglang_rollout_pod

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = os.path.join(REPO, "containers", "rollout", "serve.sh")
DEADLINE_S = 30.0
"""How long a process may take to exit: far past what a loaded 2-core box needs (well under 1 s)."""

STAND_IN = """\
import os, signal, subprocess, time
# A server slow to stop ignores SIGTERM; its child (a scheduler) always does: left behind.
if os.environ.get("RELAX_TEST_STUBBORN") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sh", "-c", "trap '' TERM; exec sleep 600"])
with open(os.environ["RELAX_TEST_PIDS"] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(os.environ["RELAX_TEST_PIDS"] + ".tmp", os.environ["RELAX_TEST_PIDS"])
time.sleep(600)
"""

PRIMARY = """\
import os, sys
from relax_core.rollout.sidecar import tell_sidecar
done = tell_sidecar(beat_s=0.05)
try:
    policy = os.environ["RELAX_MODEL_DIR"]
    os.makedirs(policy, exist_ok=True)
    open(os.path.join(policy, "READY"), "w").close()
    print("published", flush=True)
    if sys.stdin.readline().strip() == "raise":
        raise RuntimeError("the rollout failed")
finally:
    done()
"""


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name; None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields


def _group(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    return [p for p in pids if (s := _stat(p)) is not None and int(s[2]) == pgid]


def _wait_until(what: str, check) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


class Pod:
    """The shared volume, the stand-in SGLang and serve.sh's environment."""

    def __init__(self, tmp_path, **env: str):
        self.shared = tmp_path / "models"
        self.policy = self.shared / "policy"
        self.policy.mkdir(parents=True)
        shim, bin_dir = tmp_path / "shim", tmp_path / "bin"
        (shim / "sglang").mkdir(parents=True)
        (shim / "sglang" / "__init__.py").write_text("")
        (shim / "sglang" / "launch_server.py").write_text(STAND_IN)
        bin_dir.mkdir()
        os.symlink(sys.executable, bin_dir / "python3")  # serve.sh runs `python3`
        self.pids_file = tmp_path / "server.pids"
        self.log = tmp_path / "serve.log"
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": f"{shim}:{REPO}",
            "RELAX_MODEL_DIR": str(self.policy),
            "SGLANG_HOST": "127.0.0.1",
            "RELAX_POLL_S": "0.05",
            "RELAX_SIDECAR_GRACE_S": "1",
            "RELAX_PRIMARY_STALE_S": "5",
            "RELAX_TEST_PIDS": str(self.pids_file),
            **env,
        }
        self.sidecar: subprocess.Popen | None = None
        self.primaries: list[subprocess.Popen] = []

    def start_sidecar(self) -> subprocess.Popen:
        with open(self.log, "wb") as log:
            self.sidecar = subprocess.Popen(
                ["sh", SERVE], env=self.env, stderr=log, start_new_session=True
            )
        return self.sidecar

    def start_primary(self) -> subprocess.Popen:
        primary = subprocess.Popen(
            [sys.executable, "-c", PRIMARY],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.primaries.append(primary)
        assert primary.stdout.readline() == "published\n"
        return primary

    def server(self) -> tuple[int, int]:
        """(the server's pid, its child's), once the server runs."""
        _wait_until("the server did not start", self.pids_file.exists)
        server, child = map(int, self.pids_file.read_text().split())
        return server, child

    def sidecar_status(self) -> int:
        assert self.sidecar is not None
        return self.sidecar.wait(DEADLINE_S)

    def assert_all_gone(self, server: int) -> None:
        """serve.sh's process group and the server's (its own session) are empty."""
        assert self.sidecar is not None
        for pgid in (self.sidecar.pid, server):
            _wait_until(f"process group {pgid} outlived serve.sh", lambda g=pgid: not _group(g))

    def said(self) -> str:
        return self.log.read_text()

    def close(self) -> None:
        """Whatever a failed test left running, by process group and pid."""
        if self.pids_file.exists():
            server, child = map(int, self.pids_file.read_text().split())
            for pgid in (server, child):
                if _group(pgid):
                    os.killpg(pgid, signal.SIGKILL)
        if self.sidecar is not None and _group(self.sidecar.pid):
            os.killpg(self.sidecar.pid, signal.SIGKILL)
        for proc in [self.sidecar, *self.primaries]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def pod(tmp_path):
    made: list[Pod] = []

    def make(**env: str) -> Pod:
        made.append(Pod(tmp_path / str(len(made)), **env))
        return made[-1]

    yield make
    for p in made:
        p.close()


@pytest.mark.parametrize("ending", ["return", "raise"])
def test_the_server_stops_when_the_rollout_service_exits(pod, ending):
    p = pod()
    sidecar = p.start_sidecar()
    primary = p.start_primary()
    server, child = p.server()
    assert sidecar.poll() is None and _stat(server) is not None and _stat(child) is not None
    primary.communicate(ending + "\n", timeout=DEADLINE_S)
    assert primary.returncode == (0 if ending == "return" else 1)
    assert (p.shared / "DONE").exists()
    assert p.sidecar_status() == 0, p.said()
    p.assert_all_gone(server)
    assert "the rollout service finished" in p.said()


def test_the_server_stops_when_the_rollout_service_is_killed_without_a_word(pod):
    p = pod()
    sidecar = p.start_sidecar()
    primary = p.start_primary()
    server, _ = p.server()
    primary.kill()  # an OOM kill: no DONE, the heartbeat stops
    primary.wait(DEADLINE_S)
    assert not (p.shared / "DONE").exists() and sidecar.poll() is None
    old = time.time() - 10  # what RELAX_PRIMARY_STALE_S (5 s here) later looks like
    os.utime(p.shared / "HEARTBEAT", (old, old))
    assert p.sidecar_status() == 0, p.said()
    p.assert_all_gone(server)
    assert "heartbeat" in p.said() and "s old (> 5 s)" in p.said()


def test_a_server_that_dies_ends_the_sidecar_with_its_status(pod):
    p = pod()
    p.start_sidecar()
    p.start_primary()  # alive and beating throughout
    server, child = p.server()
    os.kill(server, signal.SIGKILL)
    assert p.sidecar_status() == 128 + signal.SIGKILL, p.said()
    assert "exited with status 137" in p.said()
    _wait_until("the server's child outlived it", lambda: _stat(child) is None)


def test_sigterm_to_the_sidecar_stops_the_server_sigkill_after_the_grace(pod):
    # A server that ignores SIGTERM (a shutdown that hangs) is SIGKILLed after the 1 s grace.
    p = pod(RELAX_TEST_STUBBORN="1")
    sidecar = p.start_sidecar()
    p.start_primary()
    server, child = p.server()
    sidecar.send_signal(signal.SIGTERM)  # the pod is deleted: the kubelet's SIGTERM
    assert p.sidecar_status() == 128 + signal.SIGTERM, p.said()
    p.assert_all_gone(server)
    assert "SIGTERM: stopping the SGLang server" in p.said()
    assert "outlived the 1 s grace: SIGKILL" in p.said()


def test_a_primary_gone_before_publishing_fails_the_sidecar_without_a_server(pod):
    p = pod()
    (p.shared / "HEARTBEAT").touch()
    old = time.time() - 10
    os.utime(p.shared / "HEARTBEAT", (old, old))
    assert p.start_sidecar().wait(DEADLINE_S) == 3, p.said()
    assert "before the policy was published" in p.said() and not p.pids_file.exists()
    # No heartbeat at all within $RELAX_PRIMARY_START_S: the same.
    q = pod(RELAX_PRIMARY_START_S="0")
    assert q.start_sidecar().wait(DEADLINE_S) == 3, q.said()
    assert "no heartbeat from the rollout service" in q.said() and not q.pids_file.exists()
    # DONE before READY (the service failed before publishing): nothing to serve, not a failure.
    r = pod()
    (r.shared / "DONE").touch()
    assert r.start_sidecar().wait(DEADLINE_S) == 0, r.said()
    assert not r.pids_file.exists()


def test_sigterm_to_the_primary_writes_done_and_still_ends_it(pod):
    p = pod()
    primary = p.start_primary()
    primary.send_signal(signal.SIGTERM)
    assert primary.wait(DEADLINE_S) == -signal.SIGTERM  # ended by the signal, as before
    assert (p.shared / "DONE").exists() and (p.shared / "HEARTBEAT").exists()


def test_a_rewritten_policy_keeps_the_sidecar_files(pod, tmp_path):
    p = pod()
    (p.shared / "HEARTBEAT").touch()
    (p.shared / "DONE").touch()
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"weights")
    publish_policy(str(checkpoint), str(p.policy), 4)
    assert (p.policy / "READY").exists() and (p.policy / "VERSION").read_text() == "4"
    assert (p.shared / "HEARTBEAT").exists() and (p.shared / "DONE").exists()


def test_without_a_sidecar_the_service_keeps_its_signals_and_threads():
    # A local run, or a worker with a server of its own: no $RELAX_MODEL_DIR.
    assert "RELAX_MODEL_DIR" not in os.environ
    before = signal.getsignal(signal.SIGTERM), {t.name for t in threading.enumerate()}
    tell_sidecar()()
    assert (signal.getsignal(signal.SIGTERM), {t.name for t in threading.enumerate()}) == before


def test_the_pod_outlasts_the_sidecars_grace():
    template = sglang_rollout_pod(["--tp-size", "1"], 1, {}, {}, "relax-sglang")
    spec = template.pod_spec
    sidecar = next(c for c in spec.containers if c.name == SIDECAR)
    grace = int(next(e.value for e in sidecar.env if e.name == "RELAX_SIDECAR_GRACE_S"))
    # The kubelet's SIGKILL comes after serve.sh's own grace and a poll interval (2 s).
    assert spec.termination_grace_period_seconds == POD_GRACE_S >= grace + 2 * 2
