"""A run's state on a real S3 server (SeaweedFS, shared by the session: every test writes under
a key prefix of its own):

- checkpoints are whole or not at all without a rename, the newest committed one is resumed and
  never pruned, local copies are made once per content;
- one whole colocate run, asserted many ways: its queue, checkpoints, prepared policy and
  reports on S3 with nothing on local disk, its queue's entries readable from there, a clear
  error for bad credentials, and a resume on "another machine" from the newest checkpoint.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest
import s3fs

from relax_core.queue import TransferQueue
from relax_core.queue.inspect import summarize
from relax_core.train.checkpoint import (
    STATE_FILE,
    find_resume_checkpoint,
    list_checkpoints,
    local_checkpoint,
    read_state,
    save_checkpoint,
)
from tests.conftest import REPO, write_small_config

pytestmark = [pytest.mark.integration]


def _prefix(server, name: str) -> str:
    """A key prefix of this test's own in the session's bucket."""
    return f"s3://{server.bucket}/{name}-{uuid.uuid4().hex[:8]}"


def _writer(payload: bytes, fail_after_first: bool = False):
    def write(directory: str) -> None:
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(payload)
        os.makedirs(os.path.join(directory, "optim"))
        if fail_after_first:
            raise RuntimeError("disk full")
        with open(os.path.join(directory, "optim", "optimizer.pt"), "wb") as f:
            f.write(payload[::-1])

    return write


def _fs(server) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(
        key=server.key, secret=server.secret, client_kwargs={"endpoint_url": server.endpoint_url}
    )


@pytest.fixture
def aws_env(seaweed_s3, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", seaweed_s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", seaweed_s3.secret)
    return {"client_kwargs": {"endpoint_url": seaweed_s3.endpoint_url}}


def test_checkpoints_on_s3_are_whole_or_nothing_and_pruning_keeps_the_newest(
    seaweed_s3, aws_env, tmp_path
) -> None:
    options, scratch = aws_env, str(tmp_path / "scratch")
    run = f"{_prefix(seaweed_s3, 'ckpt')}/checkpoints/r-20260101-000000-abcd"
    first = save_checkpoint(run, 1, _writer(b"v1" * 1000), {"policy_version": 1}, 2, options)
    assert first == f"{run}/step_000001"
    assert list_checkpoints(run, options) == [first]

    # A trainer killed while writing version 2 leaves no checkpoint that looks complete.
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(run, 2, _writer(b"v2", fail_after_first=True), {}, 2, options)
    # ... nor does one killed mid-upload (files there, marker not yet).
    fs = _fs(seaweed_s3)
    fs.pipe(f"{run}/step_000002/model.safetensors".removeprefix("s3://"), b"half")
    assert list_checkpoints(run, options) == [first]
    assert find_resume_checkpoint(run.rsplit("/", 1)[0], "r", options) == first

    for v in (3, 4, 5):
        save_checkpoint(run, v, _writer(f"v{v}".encode() * 100), {"policy_version": v}, 2, options)
    names = [c.rsplit("/", 1)[1] for c in list_checkpoints(run, options)]
    assert names == ["step_000004", "step_000005"]
    fs.invalidate_cache()
    prefix = run.removeprefix("s3://") + "/"
    left = {p.removeprefix(prefix).split("/")[0] for p in fs.find(prefix)}
    assert left == {"step_000004", "step_000005"}, "the half upload below them was cleaned"
    # keep: 0 still keeps the newest committed checkpoint.
    save_checkpoint(run, 6, _writer(b"v6"), {"policy_version": 6}, 0, options)
    assert [c.rsplit("/", 1)[1] for c in list_checkpoints(run, options)] == ["step_000006"]

    newest = list_checkpoints(run, options)[-1]
    state = read_state(newest, options)
    assert state["policy_version"] == 6
    assert set(state["files"]) == {"model.safetensors", "optim/optimizer.pt"}
    local = local_checkpoint(newest, options, scratch)
    with open(os.path.join(local, "model.safetensors"), "rb") as f:
        assert f.read() == b"v6"
    with open(os.path.join(local, STATE_FILE)) as f:
        assert json.load(f)["policy_version"] == 6
    # A role that never loads optimizer state does not download it.
    without = local_checkpoint(newest, options, scratch, exclude=("optim",))
    assert os.path.isfile(os.path.join(without, "model.safetensors"))
    assert not os.path.exists(os.path.join(without, "optim"))
    # Once per content: asked again, the same copy, nothing downloaded.
    fs.rm(f"{newest}/model.safetensors".removeprefix("s3://"))
    assert local_checkpoint(newest, options, scratch) == local


def test_a_checkpoint_saved_again_under_the_same_version_is_a_new_copy(
    seaweed_s3, aws_env, tmp_path
) -> None:
    options, scratch = aws_env, str(tmp_path / "scratch")
    run = f"{_prefix(seaweed_s3, 'ckpt-again')}/checkpoints/r-1"
    ckpt = save_checkpoint(run, 3, _writer(b"before"), {"policy_version": 3}, 2, options)
    before = local_checkpoint(ckpt, options, scratch)
    # A resumed run that trains version 3 again replaces it whole; the old copy is not reused.
    save_checkpoint(run, 3, _writer(b"after!"), {"policy_version": 3, "n": 2}, 2, options)
    after = local_checkpoint(ckpt, options, scratch)
    assert after != before
    with open(os.path.join(after, "model.safetensors"), "rb") as f:
        assert f.read() == b"after!"


STEPS, RESUMED_STEPS, GROUPS = 2, 4, 4  # GROUPS: SMALL_RUN's groups_per_step


def _run(cfg_path: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=240,
    )


def _config(where, name: str, **sections) -> str:
    return write_small_config(where, name, run_name="s3whole", **sections)


@pytest.fixture(scope="module")
def whole_run(seaweed_s3, tmp_path_factory) -> SimpleNamespace:
    """A colocate run of STEPS steps with `storage.root` on S3 and what it left, a rerun with a
    wrong secret, and the run resumed to RESUMED_STEPS with a fresh local temp dir."""
    where = tmp_path_factory.mktemp("s3whole")
    os.symlink(os.path.join(REPO, "datasets"), where / "datasets")
    root = _prefix(seaweed_s3, "whole-run")
    storage = {"root": root, "endpoint_url": seaweed_s3.endpoint_url}
    env = {"AWS_ACCESS_KEY_ID": seaweed_s3.key, "AWS_SECRET_ACCESS_KEY": seaweed_s3.secret}
    options = seaweed_s3.storage_options()  # this process reads with them, not the environment
    fs = seaweed_s3.filesystem()
    run = SimpleNamespace(root=root, options=options)

    cfg = _config(where, "s3.yaml", train={"total_steps": STEPS}, storage=storage)
    first = _run(cfg, {**env, "TMPDIR": str(where / "tmp")}, where)
    assert first.returncode == 0, first.stdout + first.stderr
    run.local_state = (where / ".relax").exists()
    run.listing = sorted(
        p.rsplit("/", 1)[1] for p in fs.ls(root.removeprefix("s3://"), refresh=True)
    )
    run.found = find_resume_checkpoint(f"{root}/checkpoints", "s3whole", options)
    run.state = read_state(run.found, options)
    summary = f"{run.found.rsplit('/', 1)[0]}/summary.json".removeprefix("s3://")
    run.summary = json.loads(fs.cat(summary))

    run.bad = _run(cfg, {**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}, where)

    resumed = _config(
        where,
        "s3-resume.yaml",
        train={"total_steps": RESUMED_STEPS},
        storage=storage,
        checkpoint={"resume": True},
    )
    run.again = _run(resumed, {**env, "TMPDIR": str(where / "tmp2")}, where)
    run.final = find_resume_checkpoint(f"{root}/checkpoints", "s3whole", options)
    return run


@pytest.mark.slow
def test_a_whole_run_keeps_its_state_on_s3_and_nothing_on_local_disk(whole_run) -> None:
    run = whole_run
    assert not run.local_state, "no run state on local disk"
    assert run.listing == ["checkpoints", "policies", "queue"]
    assert run.state["policy_version"] == STEPS
    assert run.summary["checkpoint"] == run.found


@pytest.mark.slow
def test_the_queue_on_s3_holds_every_step_of_the_run(whole_run) -> None:
    """Read after the resume: the resumed run appended to the same queue."""
    queue = TransferQueue(f"{whole_run.root}/queue", whole_run.state["run_id"], whole_run.options)
    summary = summarize(queue)
    rollout, ready = summary["stages"]["rollout"], summary["stages"]["ready"]
    assert rollout["entries"] == RESUMED_STEPS, summary
    assert ready["groups"] == RESUMED_STEPS * GROUPS, summary
    assert ready["lag_at_commit"] == {0: RESUMED_STEPS * GROUPS}, summary  # colocate: on-policy


@pytest.mark.slow
def test_bad_credentials_stop_the_run_with_an_error_naming_the_storage(whole_run) -> None:
    bad = whole_run.bad
    assert bad.returncode != 0
    assert "queue.root: access denied" in bad.stderr, bad.stderr
    assert whole_run.root in bad.stderr, bad.stderr


@pytest.mark.slow
def test_a_resume_on_another_machine_continues_from_the_newest_checkpoint_on_s3(
    whole_run,
) -> None:
    """Nothing local (a fresh temp dir): the newest committed checkpoint comes from S3."""
    run = whole_run
    assert run.again.returncode == 0, run.again.stdout + run.again.stderr
    assert run.final.rsplit("/", 1)[0] == run.found.rsplit("/", 1)[0], "the same run continued"
    assert read_state(run.final, run.options)["policy_version"] == RESUMED_STEPS
