"""A colocate run whose queue lives on a real S3 server (SeaweedFS), as on a cluster."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relax_core.queue import TransferQueue
from relax_core.queue.inspect import summarize
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _run(cfg_path: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=600,
    )


def test_run_with_its_queue_on_s3_and_a_clear_error_for_bad_credentials(
    seaweed_s3, small_config, workdir
) -> None:
    env = {"AWS_ACCESS_KEY_ID": seaweed_s3.key, "AWS_SECRET_ACCESS_KEY": seaweed_s3.secret}
    queue_cfg = {"root": f"s3://{seaweed_s3.bucket}/runs", "endpoint_url": seaweed_s3.endpoint_url}
    cfg = small_config("s3.yaml", run_name="s3run", train={"total_steps": 3}, queue=queue_cfg)
    done = _run(cfg, env)
    assert done.returncode == 0, done.stdout + done.stderr
    state = read_state(find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "s3run"))
    queue = TransferQueue(queue_cfg["root"], state["run_id"], seaweed_s3.storage_options())
    summary = summarize(queue)
    groups = 4  # small_config: groups_per_step
    assert summary["stages"]["rollout"]["entries"] == 3
    assert summary["stages"]["ready"]["groups"] == 3 * groups
    assert summary["stages"]["ready"]["lag_at_commit"] == {0: 3 * groups}
    assert not os.path.exists(workdir / ".relax" / "queue"), "nothing went to local disk"

    bad = _run(cfg, {**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert bad.returncode != 0
    assert "queue.root: access denied" in bad.stderr
    assert f"s3://{seaweed_s3.bucket}/runs" in bad.stderr
