"""Faults from outside an async run whose storage is a real S3 server (SeaweedFS):

- the server crashes mid-run and comes back on its port and data: every role waits, saying
  so, nobody is restarted for the heartbeats it could not write, and the run goes on;
- SIGTERM (a preempted pod) checkpoints the step under way, and the rerun resumes from it;
- an outage past `storage.outage_limit_s` stops the run with a clear error, and once the
  server is back the rerun resumes from the checkpoints it left;

and at the end the queue's audit finds no group and no prompt lost or trained twice.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from relax_core.queue import TransferQueue
from relax_core.storage import read_json
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 50
_STEP = re.compile(r"\bstep (\d+)/\d+ ")
SILENCE_S = 8.0
"""services.heartbeat_timeout_s: no role of a loaded 2-core box goes this long without
touching its liveness file (MEASURED), so a restart here can only come from the outage."""
OUTAGE_S = 10.0
"""Longer than SILENCE_S: a supervisor counting the outage as silence would kill."""


class _Run:
    """A whole run in a subprocess, its output collected line by line as it comes."""

    def __init__(self, cfg_path: str, env: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def step(self) -> int:
        """The newest step the trainer logged ("step N/M ..." every 10 steps)."""
        found = (_STEP.search(line) for line in list(self.lines))
        return max((int(m.group(1)) for m in found if m), default=0)

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while self.step() < step:
            assert self.proc.poll() is None, self.out
            assert time.time() < deadline, self.out
            time.sleep(0.05)

    def end(self, timeout: float = 300) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self._reader.join(10)
            raise AssertionError(f"the run did not end within {timeout} s:\n{self.out}") from None
        self._reader.join(10)
        return self.proc.returncode


@pytest.fixture
def server(seaweed_s3):
    """The session's SeaweedFS, running again when the test ends whatever happened."""
    yield seaweed_s3
    if seaweed_s3.process.poll() is not None:
        seaweed_s3.restart()


@pytest.fixture
def runs():
    """Every _Run the test starts; one still running when the test ends is stopped as a pod
    is (SIGTERM: the supervisor stops its roles), then killed."""
    started: list[_Run] = []
    yield started
    for run in started:
        if run.proc.poll() is None:
            run.proc.terminate()
            try:
                run.proc.wait(120)
            except subprocess.TimeoutExpired:
                run.proc.kill()
                run.proc.wait()


@pytest.mark.soak
def test_an_async_run_on_s3_outlives_outages_and_preemption(server, runs, small_config, workdir):
    from relax_core.config import load_config
    from relax_core.data import PromptSampler, load_prompts
    from relax_core.queue.audit import audit_run
    from relax_core.queue.coverage import coverage_errors, read_prompt_coverage

    env = {"AWS_ACCESS_KEY_ID": server.key, "AWS_SECRET_ACCESS_KEY": server.secret}
    root = f"s3://{server.bucket}/outage-{uuid.uuid4().hex[:8]}"  # this test's own prefix
    sections = dict(
        run_name="o",
        mode="async",
        rollout={"max_staleness": 1},
        algorithm={"proximal": "behaviour"},
        train={"total_steps": STEPS, "checkpoint_every": 20},
        storage={"root": root, "endpoint_url": server.endpoint_url, "outage_limit_s": 120},
        services={
            "trainer_threads": 1,
            "poll_s": 0.01,
            "heartbeat_s": 0.5,
            "heartbeat_timeout_s": SILENCE_S,
            "preemption_grace_s": 60,
        },
    )
    options = server.storage_options()  # this process reads the run's storage too

    # 1. The server crashes at step >= 10 and is back OUTAGE_S later; then SIGTERM at >= 20.
    run = _Run(small_config("o.yaml", **sections), env)
    runs.append(run)
    run.wait_for_step(10)
    server.crash()
    try:
        time.sleep(OUTAGE_S)  # the outage itself
    finally:
        server.restart()
    run.wait_for_step(20)
    run.proc.send_signal(signal.SIGTERM)
    assert run.end() == 128 + signal.SIGTERM, run.out
    out = run.out
    assert f"storage at {root}" in out and "is unreachable" in out, out
    assert "waiting up to 120 s for it (storage.outage_limit_s)" in out
    assert "answers again after" in out
    preempted = find_resume_checkpoint(f"{root}/checkpoints", "o", options)
    state = read_state(preempted, options)
    version = state["policy_version"]
    assert 20 <= version < STEPS, out
    assert f"preempted (SIGTERM): checkpoint of policy version {version} written at" in out
    run_dir = os.path.dirname(preempted)
    recovery = read_json(f"{run_dir}/recovery.json", options)
    # Nobody was killed for the heartbeats storage could not take, nor failed waiting for it.
    assert recovery["role_restarts"] == {} and recovery["global_restarts"] == 0, recovery

    # 2. Resumed with a 3 s limit, the server crashes again and stays down past it.
    resumed = dict(sections, checkpoint={"resume": True})
    resumed["storage"] = {**sections["storage"], "outage_limit_s": 3}
    run = _Run(small_config("o2.yaml", **resumed), env)
    runs.append(run)
    run.wait_for_step(version + 10)
    server.crash()
    try:
        code = run.end(timeout=120)
    finally:
        server.restart()
    out = run.out
    assert code == 75, out
    assert "past storage.outage_limit_s = 3 s" in out, out
    assert "run again with checkpoint.resume: true" in out, out
    stopped_at = read_state(find_resume_checkpoint(f"{root}/checkpoints", "o", options), options)
    assert stopped_at["run_id"] == state["run_id"] and stopped_at["policy_version"] >= version

    # 3. Resumed once more, the run ends; nothing was lost or trained twice on the way.
    resumed["storage"] = sections["storage"]
    run = _Run(small_config("o3.yaml", **resumed), env)
    runs.append(run)
    assert run.end(timeout=200) == 0, run.out
    final = read_state(find_resume_checkpoint(f"{root}/checkpoints", "o", options), options)
    assert final["run_id"] == state["run_id"] and final["policy_version"] == STEPS
    queue = TransferQueue(f"{root}/queue", final["run_id"], options)
    audit = audit_run(queue, final)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    sampler = PromptSampler(len(load_prompts(load_config(small_config()).data.train_path)), seed=0)
    coverage = read_prompt_coverage(queue, sampler.num_prompts, sampler.order)
    assert coverage_errors(coverage) == 0, json.dumps(coverage)
