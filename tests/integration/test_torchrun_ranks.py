"""A trainer over several GPUs is torchrun and its ranks, and torchrun starts each rank in a
session of its own: the supervisor's SIGKILL to the trainer's process group (a silent trainer, a
start past services.start_timeout_s) reaches torchrun only. The ranks must end with it
(relax_core/roles/torchrun.py), or an old rank 0 trains on beside the trainer that replaced it
and holds the run's console open after the run ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.runs import running

pytestmark = pytest.mark.integration

RANK = """
import os, sys, time
from relax_core.roles.torchrun import die_with_torchrun

die_with_torchrun()
with open(os.path.join(sys.argv[1], "rank%s.pid" % os.environ["RANK"]), "w") as f:
    f.write(str(os.getpid()))
time.sleep(300)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_ranks_end_when_the_supervisor_kills_torchruns_group(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    proc = subprocess.Popen(
        [*torchrun, "--nproc-per-node", "2", str(script), str(tmp_path)],
        start_new_session=True,  # as the supervisor starts a multi-GPU trainer
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    files = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not all(f.exists() and f.read_text() for f in files):
            assert proc.poll() is None and time.monotonic() < deadline, "torchrun never started"
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in files]
        assert all(running(p) for p in pids)
        os.killpg(proc.pid, signal.SIGKILL)  # what the supervisor does to a silent trainer
        proc.wait()
        deadline = time.monotonic() + 20
        while any(running(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(running(p) for p in pids), "a rank outlived torchrun"
    finally:
        for pid in pids:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
