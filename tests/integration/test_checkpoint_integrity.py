"""Checkpoints a resume must not trust, and a disk that fills up while a run writes one.

- A real colocate run whose newest checkpoint is truncated: resuming it is refused with the file
  named, and with `checkpoint.fallback_to_previous` the run resumes the previous one and finishes.
- A real colocate run with `checkpoint.dir` on a small tmpfs that holds its first checkpoint but
  not the next: the run fails naming the place, nothing half-written is left or listed, and once
  space is freed the run resumes from the checkpoint that fit.
- On an object store (moto): a truncated file is refused by size before any download, a changed
  one by its sha256 as it is downloaded.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import shutil
import subprocess

import pytest
import s3fs
import torch

from relax_core.config import ConfigError, load_config
from relax_core.run.lifecycle import preflight, run
from relax_core.train.checkpoint import (
    STATE_FILE,
    CorruptCheckpoint,
    find_resume_checkpoint,
    list_checkpoints,
    local_checkpoint,
    read_state,
    save_checkpoint,
    verify_checkpoint,
)
from tests import needs

pytestmark = pytest.mark.integration

TRAIN = {"total_steps": 4, "checkpoint_every": 2, "steps_per_node": 4, "keep_checkpoints": 10}


def test_a_corrupt_newest_checkpoint_is_refused_and_the_previous_one_resumed_when_asked(
    small_config, workdir, caplog
):
    first = run(load_config(small_config("a.yaml", run_name="c", train=TRAIN)))
    run_dir = os.path.dirname(first["checkpoint"])
    v0, v2, v4 = list_checkpoints(run_dir)
    model = os.path.join(v4, "model.safetensors")
    size = os.path.getsize(model)
    with open(model, "r+b") as f:
        f.truncate(size // 2)

    resume = {"resume": True}
    with pytest.raises(CorruptCheckpoint) as refused:
        run(load_config(small_config("b.yaml", run_name="c", train=TRAIN, checkpoint=resume)))
    text = str(refused.value)
    assert f"{model}: expected {size} bytes" in text and f"found {size // 2}" in text
    assert f"previous complete checkpoint is {v2}" in text
    assert "checkpoint.fallback_to_previous: true" in text

    # Pointed at by hand, the corrupt one and a step directory without state.json are refused
    # before anything loads, each with what is wrong and the checkpoint to take instead.
    half = os.path.join(run_dir, "step_000003")
    shutil.copytree(v2, half)
    os.unlink(os.path.join(half, STATE_FILE))
    for target, wrong in ((v4, f"{model}: expected {size} bytes"), (half, f"{half}/state.json")):
        cfg = small_config("c.yaml", run_name="c", train=TRAIN, checkpoint={"resume_from": target})
        with pytest.raises(ConfigError) as bad:
            preflight(load_config(cfg))
        assert f"checkpoint.resume_from: {wrong}" in str(bad.value)
        assert f"checkpoint.resume_from: {v2}" in str(bad.value)

    fallback = {"resume": True, "fallback_to_previous": True}
    with caplog.at_level(logging.WARNING, logger="relax_core.train.checkpoint"):
        summary = run(
            load_config(small_config("d.yaml", run_name="c", train=TRAIN, checkpoint=fallback))
        )
    assert f"skipping corrupt checkpoint {v4}: {model}: expected {size} bytes" in caplog.text
    assert summary["run_id"] == first["run_id"] and summary["steps"] == 4
    # Training from v2 wrote v4 again, whole, in place of the corrupt one.
    assert summary["checkpoint"] == v4 and verify_checkpoint(v4) == ""
    assert read_state(v4)["policy_version"] == 4
    assert find_resume_checkpoint(os.path.dirname(run_dir), "c") == v4


@pytest.fixture
def small_disk(workdir):
    """A tmpfs mounted at `disk/` of the work dir: yields (path, resize(size)); unmounted after."""
    path = workdir / "disk"
    path.mkdir()
    if os.geteuid() != 0:
        needs.missing("mounting a tmpfs needs root (CAP_SYS_ADMIN)", "run the tests as root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=200k", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        needs.missing(
            f"cannot mount a tmpfs here: {mounted.stderr.strip()}", "run as root with CAP_SYS_ADMIN"
        )

    def resize(size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)

    try:
        yield str(path), resize
    finally:
        # The run's policy may still map its checkpoint's safetensors (objects in reference
        # cycles); a lazy unmount detaches the tmpfs now and frees it once they are collected.
        gc.collect()
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(path)], check=True)


def test_a_full_disk_fails_the_run_naming_the_place_and_a_resume_after_freeing_space_finishes(
    small_config, small_disk
):
    # A checkpoint of the tiny model takes 25 tmpfs pages (100 KiB) at version 0, 50 once the
    # optimizer has state: 200 KiB holds version 0 and not version 2.
    disk, resize = small_disk
    root = os.path.join(disk, "checkpoints")
    sections = {"run_name": "full", "train": TRAIN, "checkpoint": {"dir": root}}
    with pytest.raises(OSError) as full:
        run(load_config(small_config("a.yaml", **sections)))
    (run_id,) = os.listdir(root)
    run_dir = os.path.join(root, run_id)
    v0 = os.path.join(run_dir, "step_000000")
    assert full.value.errno == errno.ENOSPC
    text = str(full.value)
    assert f"no space left on device writing checkpoint {run_dir}/step_000002" in text
    assert f"(checkpoint.dir={root})" in text and "point checkpoint.dir elsewhere" in text
    assert f"the newest complete checkpoint is {v0}" in text
    # Nothing half-written: no staging directory eats the space, no step without its marker.
    assert os.listdir(run_dir) == ["step_000000"]
    assert list_checkpoints(run_dir) == [v0] and verify_checkpoint(v0) == ""

    resize("4m")  # space freed
    resumed = {**sections, "checkpoint": {"dir": root, "resume": True}}
    summary = run(load_config(small_config("b.yaml", **resumed)))
    assert summary["run_id"] == run_id and summary["steps"] == 4
    assert [read_state(c)["policy_version"] for c in list_checkpoints(run_dir)] == [0, 2, 4]
    assert all(verify_checkpoint(c) == "" for c in list_checkpoints(run_dir))


def test_a_queue_write_on_a_full_disk_names_the_place_and_leaves_nothing(small_disk):
    from relax_core.queue.store import ObjectStore

    disk, _ = small_disk
    store = ObjectStore(disk)
    store.write_immutable("small", b"x" * 1000)
    with pytest.raises(OSError, match=r"no space left on device writing .*/disk/big .*queue.root"):
        store.write_immutable("big", b"x" * 400_000)
    assert sorted(os.listdir(disk)) == ["small"]  # no temp file, no partial entry


def test_torch_save_filling_the_disk_is_told_apart_from_other_errors(small_disk):
    # torch.save reports a full disk without errno ("unexpected pos ..."); the free space says it.
    disk, _ = small_disk
    run_dir = os.path.join(disk, "r-20260101-000000-aaaa")

    def optimizer_state(directory: str) -> None:
        torch.save({"exp_avg": torch.zeros(100_000)}, os.path.join(directory, "optimizer.pt"))

    with pytest.raises(OSError, match="no space left on device writing checkpoint") as full:
        save_checkpoint(run_dir, 1, optimizer_state, {"policy_version": 1}, keep=2)
    assert full.value.errno == errno.ENOSPC
    assert "this run has no complete checkpoint yet" in str(full.value)
    assert os.listdir(run_dir) == []
    # The failed writer's file is closed, not only unlinked: its space is free again while the
    # error is still held (the test holds it here).
    assert shutil.disk_usage(disk).used < 16 << 10


def test_on_an_object_store_a_truncated_file_is_refused_and_a_changed_one_on_download(
    moto_s3, monkeypatch, tmp_path
):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_s3.key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_s3.secret)
    options = {"client_kwargs": {"endpoint_url": moto_s3.endpoint_url}}
    fs = s3fs.S3FileSystem(
        key=moto_s3.key, secret=moto_s3.secret, client_kwargs=options["client_kwargs"]
    )
    run_dir = f"s3://{moto_s3.bucket}/integrity/checkpoints/r-20260101-000000-abcd"

    def write_model(directory: str) -> None:
        with open(os.path.join(directory, "model.safetensors"), "wb") as f:
            f.write(b"w" * 1000)

    old = save_checkpoint(run_dir, 1, write_model, {"policy_version": 1}, 5, options)
    new = save_checkpoint(run_dir, 2, write_model, {"policy_version": 2}, 5, options)
    fs.pipe_file(f"{new}/model.safetensors", b"w" * 10)
    problem = verify_checkpoint(new, options)
    assert f"{new}/model.safetensors: expected 1000 bytes" in problem and "found 10" in problem
    with pytest.raises(CorruptCheckpoint, match=f"previous complete checkpoint is {old}"):
        find_resume_checkpoint(os.path.dirname(run_dir), "r", options)

    fs.pipe_file(f"{new}/model.safetensors", b"x" * 1000)  # same size, other bytes
    assert verify_checkpoint(new, options) == ""  # sizes only, before any download
    with pytest.raises(OSError, match="model.safetensors: downloaded content differs"):
        local_checkpoint(new, options, str(tmp_path / "scratch"))
