"""What a killed writer leaves (a staging directory as large as a checkpoint) is removed by the
next publish or copy beside it, once nothing has written it for STALE_STAGING_S; a live
writer's staging, and everything that is not staging, stays."""

from __future__ import annotations

import logging
import os
import time
import uuid

from relax_core.storage.dirs import (
    STALE_STAGING_S,
    local_copy,
    publish_dir,
    sweep_stale_staging,
)

MARKER = "DONE.json"
HOURS = 3600.0


def _age(path, seconds: float) -> None:
    """Set the mtime of `path` and everything under it `seconds` back."""
    when = time.time() - seconds
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.utime(os.path.join(root, name), (when, when))
    os.utime(path, (when, when))


def _staging(parent, name: str, age_s: float, size: int = 1024):
    path = parent / name
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * size)
    _age(path, age_s)
    return path


def _build(staging: str) -> dict:
    with open(os.path.join(staging, "weights.bin"), "wb") as f:
        f.write(b"new weights")
    return {"step": 100}


def test_a_publish_removes_a_killed_writers_staging_and_keeps_a_live_one(tmp_path, caplog):
    run = tmp_path / "run"
    dead = _staging(run, ".tmp-dead", STALE_STAGING_S + 1 * HOURS, size=1 << 20)
    live = _staging(run, ".tmp-live", 60.0)
    kept = _staging(run, "step_000050", 10 * STALE_STAGING_S)  # a checkpoint, however old
    leftover_json = run / ".tmp-0123abcd"  # write_json's temporary file, its writer killed
    leftover_json.write_text("{")
    _age(leftover_json, STALE_STAGING_S + 60)

    with caplog.at_level(logging.WARNING, logger="relax_core.storage.dirs"):
        published = publish_dir(str(run / "step_000100"), MARKER, _build)

    assert (run / "step_000100" / "weights.bin").read_bytes() == b"new weights"
    assert published == str(run / "step_000100")
    assert not dead.exists() and not leftover_json.exists()
    assert live.exists() and kept.exists()
    assert sorted(os.listdir(run)) == [".tmp-live", "step_000050", "step_000100"]
    removed = [r.getMessage() for r in caplog.records]
    assert any(str(dead) in m and "staging leftover" in m for m in removed)
    assert not any(str(live) in m for m in removed)


def test_a_writer_still_filling_one_large_file_is_live_however_old_its_directory(tmp_path):
    staging = _staging(tmp_path, ".tmp-slow", STALE_STAGING_S * 2)
    os.utime(staging / "model.safetensors")  # the file it is writing moved just now
    assert sweep_stale_staging(str(tmp_path), ".tmp-*") == []
    assert staging.exists()


def test_only_the_pattern_is_swept_and_a_missing_directory_is_nothing_to_do(tmp_path):
    _staging(tmp_path, "policy.tmp-1", STALE_STAGING_S * 2)
    _staging(tmp_path, "tiny-0123", STALE_STAGING_S * 2)
    assert sweep_stale_staging(str(tmp_path), ".tmp-*") == []
    assert sweep_stale_staging(str(tmp_path / "absent"), ".tmp-*") == []
    assert sweep_stale_staging(str(tmp_path), "*.tmp-*") == [str(tmp_path / "policy.tmp-1")]
    assert os.listdir(tmp_path) == ["tiny-0123"]


def test_a_remote_publish_and_a_copy_sweep_their_scratch(tmp_path):
    """Through an object store (fsspec's memory filesystem takes the remote branch): the
    publish stages in scratch, the copy downloads into scratch/copies; each clears what a
    killed process left there."""
    scratch = tmp_path / "scratch"
    dead_publish = _staging(scratch, ".publish-dead", STALE_STAGING_S + HOURS)
    live_publish = _staging(scratch, ".publish-live", 5.0)
    location = f"memory://relax-sweep-{uuid.uuid4().hex}/run/step_000100"

    publish_dir(location, MARKER, _build, scratch_dir=str(scratch))
    assert not dead_publish.exists() and live_publish.exists()

    copies = scratch / "copies"
    dead_copy = _staging(copies, "0123456789abcdef01234567.tmp-dead", STALE_STAGING_S + HOURS)
    copy = local_copy(location, MARKER, scratch_dir=str(scratch))
    with open(os.path.join(copy, "weights.bin"), "rb") as f:
        assert f.read() == b"new weights"
    assert not dead_copy.exists()
    assert sorted(os.listdir(copies)) == [os.path.basename(copy)]
