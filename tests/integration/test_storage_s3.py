"""A run's state on a real S3 server (SeaweedFS): checkpoints whole or not at all without a
rename, the newest committed one resumed and never pruned, local copies made once per content,
and a whole run (queue, checkpoints, prepared policy, reports) with nothing on local disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import s3fs

from relax_core.train.checkpoint import (
    STATE_FILE,
    find_resume_checkpoint,
    list_checkpoints,
    local_checkpoint,
    read_state,
    save_checkpoint,
)

pytestmark = [pytest.mark.integration]


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
    run = f"s3://{seaweed_s3.bucket}/ckpt-test/checkpoints/r-20260101-000000-abcd"
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
    run = f"s3://{seaweed_s3.bucket}/ckpt-again/checkpoints/r-1"
    ckpt = save_checkpoint(run, 3, _writer(b"before"), {"policy_version": 3}, 2, options)
    before = local_checkpoint(ckpt, options, scratch)
    # A resumed run that trains version 3 again replaces it whole; the old copy is not reused.
    save_checkpoint(run, 3, _writer(b"after!"), {"policy_version": 3, "n": 2}, 2, options)
    after = local_checkpoint(ckpt, options, scratch)
    assert after != before
    with open(os.path.join(after, "model.safetensors"), "rb") as f:
        assert f.read() == b"after!"


def _run(cfg_path: str, env: dict, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        cwd=cwd,
        timeout=600,
    )


@pytest.mark.slow
def test_a_whole_run_keeps_its_state_on_s3_and_resumes_from_there(
    seaweed_s3, small_config, workdir
) -> None:
    env = {
        "AWS_ACCESS_KEY_ID": seaweed_s3.key,
        "AWS_SECRET_ACCESS_KEY": seaweed_s3.secret,
        "TMPDIR": str(workdir / "tmp"),
    }
    root = f"s3://{seaweed_s3.bucket}/whole-run"
    storage = {"root": root, "endpoint_url": seaweed_s3.endpoint_url}
    cfg = small_config("s3.yaml", run_name="s3whole", train={"total_steps": 2}, storage=storage)
    done = _run(cfg, env, workdir)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not (workdir / ".relax").exists(), "no run state on local disk"
    fs = _fs(seaweed_s3)
    bucket_root = root.removeprefix("s3://")
    assert sorted(p.rsplit("/", 1)[1] for p in fs.ls(bucket_root, refresh=True)) == [
        "checkpoints",
        "policies",
        "queue",
    ]
    options = {"client_kwargs": {"endpoint_url": seaweed_s3.endpoint_url}}
    os.environ.update({k: env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})
    found = find_resume_checkpoint(f"{root}/checkpoints", "s3whole", options)
    assert read_state(found, options)["policy_version"] == 2
    run_dir = found.rsplit("/", 1)[0]
    summary = json.loads(fs.cat(f"{run_dir}/summary.json".removeprefix("s3://")))
    assert summary["checkpoint"] == found

    # Resume on "another machine": nothing local, the newest committed checkpoint from S3.
    resumed = small_config(
        "s3-resume.yaml",
        run_name="s3whole",
        train={"total_steps": 4},
        storage=storage,
        checkpoint={"resume": True},
    )
    again = _run(resumed, {**env, "TMPDIR": str(workdir / "tmp2")}, workdir)
    assert again.returncode == 0, again.stdout + again.stderr
    final = find_resume_checkpoint(f"{root}/checkpoints", "s3whole", options)
    assert final.rsplit("/", 1)[0] == run_dir, "the same run continued"
    assert read_state(final, options)["policy_version"] == 4
