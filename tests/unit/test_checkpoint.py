"""Checkpoints are all-or-nothing, pruned to the newest few, found again by run name, verified
against the files their state.json lists before a resume takes them, and a full disk while
writing one is an error that names the place and leaves nothing behind."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os

import pytest
import torch

from relax_core.config import load_config
from relax_core.ops.supervisor import Supervisor
from relax_core.storage import remove_dir
from relax_core.train.checkpoint import (
    CorruptCheckpoint,
    decode_rng,
    encode_rng,
    find_resume_checkpoint,
    list_checkpoints,
    newest_complete,
    previous_complete,
    read_state,
    resume_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)


def _write(directory: str) -> None:
    with open(os.path.join(directory, "model.bin"), "w") as f:
        f.write("weights")


def test_save_prunes_to_keep_and_lists_oldest_first(tmp_path):
    run = str(tmp_path / "r-1")
    for v in (2, 4, 6):
        save_checkpoint(run, v, _write, {"policy_version": v}, keep=2)
    found = list_checkpoints(run)
    assert [read_state(c)["policy_version"] for c in found] == [4, 6]
    assert os.path.isfile(os.path.join(found[-1], "model.bin"))


def test_a_crash_while_writing_leaves_no_checkpoint(tmp_path):
    run = str(tmp_path / "r-1")
    save_checkpoint(run, 1, _write, {"policy_version": 1}, keep=5)

    def crash(directory: str) -> None:
        _write(directory)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(run, 2, crash, {"policy_version": 2}, keep=5)
    assert [read_state(c)["policy_version"] for c in list_checkpoints(run)] == [1]
    assert sorted(os.listdir(run)) == ["step_000001"]  # no staging directory left behind


def test_resume_finds_newest_run_with_a_checkpoint(tmp_path):
    root = str(tmp_path)
    save_checkpoint(os.path.join(root, "exp-20260101-000000-aaaa"), 3, _write, {"v": 3}, keep=2)
    os.makedirs(os.path.join(root, "exp-20260102-000000-bbbb"))  # newer but empty: crashed at start
    save_checkpoint(os.path.join(root, "other-20260103-000000-cccc"), 9, _write, {"v": 9}, keep=2)
    found = find_resume_checkpoint(root, "exp")
    assert found is not None and found.endswith("exp-20260101-000000-aaaa/step_000003")
    assert find_resume_checkpoint(root, "missing") is None


def test_read_state_of_a_non_checkpoint_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a checkpoint"):
        read_state(str(tmp_path))


def test_rng_state_round_trips_through_text():
    gen = torch.Generator().manual_seed(7)
    text = encode_rng(gen.get_state())
    expected = torch.rand(4, generator=gen)
    gen2 = torch.Generator()
    gen2.set_state(decode_rng(text))
    assert torch.equal(torch.rand(4, generator=gen2), expected)


# --- integrity ----------------------------------------------------------------------------------

MODEL = b"\x01\x02" * 500  # 1000 bytes standing in for model.safetensors


def _write_model(directory: str) -> None:
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(MODEL)
    os.makedirs(os.path.join(directory, "optim"))
    with open(os.path.join(directory, "optim", "optimizer.pt"), "wb") as f:
        f.write(b"adam")


def _two_checkpoints(tmp_path) -> tuple[str, str, str]:
    """(root, step 2, step 4) of one run named `exp`."""
    root = str(tmp_path)
    run = os.path.join(root, "exp-20260101-000000-aaaa")
    old = save_checkpoint(run, 2, _write_model, {"policy_version": 2}, keep=5)
    new = save_checkpoint(run, 4, _write_model, {"policy_version": 4}, keep=5)
    return root, old, new


def test_a_local_state_json_lists_every_file_with_its_size_and_sha256(tmp_path):
    _, _, new = _two_checkpoints(tmp_path)
    files = read_state(new)["files"]
    assert files == {
        "model.safetensors": {"size": 1000, "sha256": hashlib.sha256(MODEL).hexdigest()},
        "optim/optimizer.pt": {"size": 4, "sha256": hashlib.sha256(b"adam").hexdigest()},
    }
    assert verify_checkpoint(new) == ""


def test_a_truncated_model_is_refused_naming_the_file_the_sizes_and_the_previous_checkpoint(
    tmp_path,
):
    root, old, new = _two_checkpoints(tmp_path)
    with open(os.path.join(new, "model.safetensors"), "r+b") as f:
        f.truncate(300)
    with pytest.raises(CorruptCheckpoint) as refused:
        find_resume_checkpoint(root, "exp")
    text = str(refused.value)
    assert f"{new}/model.safetensors: expected 1000 bytes" in text and "found 300" in text
    assert f"previous complete checkpoint is {old}" in text
    assert f"checkpoint.resume_from: {old}" in text
    assert "checkpoint.fallback_to_previous: true" in text
    with pytest.raises(CorruptCheckpoint, match="model.safetensors: expected 1000 bytes"):
        resume_checkpoint(os.path.dirname(new))


def test_with_fallback_a_corrupt_newest_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    root, old, new = _two_checkpoints(tmp_path)
    os.unlink(os.path.join(new, "optim", "optimizer.pt"))
    with caplog.at_level(logging.WARNING):
        assert find_resume_checkpoint(root, "exp", fallback=True) == old
        assert resume_checkpoint(os.path.dirname(new), fallback=True) == old
    assert f"{new}/optim/optimizer.pt is missing" in caplog.text


def test_flipped_bytes_of_the_right_size_are_refused_by_their_hash(tmp_path):
    _, old, new = _two_checkpoints(tmp_path)
    with open(os.path.join(new, "model.safetensors"), "r+b") as f:
        f.seek(500)
        f.write(b"\xff\xff")
    problem = verify_checkpoint(new)
    assert f"{new}/model.safetensors" in problem and "sha256" in problem
    assert previous_complete(new) == old


def test_a_file_truncated_after_a_checkpoint_verified_is_still_found(tmp_path):
    _, _, new = _two_checkpoints(tmp_path)
    assert verify_checkpoint(new) == ""  # remembered, so a supervisor does not hash it again
    with open(os.path.join(new, "model.safetensors"), "r+b") as f:
        f.truncate(999)
    assert "found 999" in verify_checkpoint(new)


def test_a_checkpoint_pruned_after_it_was_listed_is_passed_over_not_refused(tmp_path):
    # A supervisor lists the run's checkpoints while its trainer writes and prunes them.
    _, old, new = _two_checkpoints(tmp_path)
    listed = list_checkpoints(os.path.dirname(new))[::-1]
    remove_dir(new, "state.json")
    assert newest_complete(listed) == old


def test_a_step_dir_without_state_json_is_no_checkpoint_and_naming_it_says_what_is_missing(
    tmp_path,
):
    root, old, new = _two_checkpoints(tmp_path)
    os.unlink(os.path.join(new, "state.json"))  # a half-written one, or its marker deleted
    assert list_checkpoints(os.path.dirname(new)) == [old]
    assert find_resume_checkpoint(root, "exp") == old
    assert f"{new}/state.json is missing" in verify_checkpoint(new)
    assert previous_complete(new) == old


def test_a_state_json_that_is_not_json_is_refused(tmp_path):
    _, _, new = _two_checkpoints(tmp_path)
    with open(os.path.join(new, "state.json"), "w") as f:
        f.write('{"policy_version": 4, "fi')
    assert f"{new}/state.json is not valid JSON" in verify_checkpoint(new)


def test_a_checkpoint_whose_state_json_lists_no_files_passes_on_its_marker(tmp_path):
    _, _, new = _two_checkpoints(tmp_path)
    path = os.path.join(new, "state.json")
    with open(path) as f:
        state = json.load(f)
    del state["files"]  # written before markers listed files
    with open(path, "w") as f:
        json.dump(state, f)
    assert verify_checkpoint(new) == ""


def test_pruning_after_resuming_past_a_corrupt_checkpoint_keeps_what_the_run_writes(tmp_path):
    root, old, new = _two_checkpoints(tmp_path)
    run = os.path.dirname(new)
    with open(os.path.join(new, "model.safetensors"), "r+b") as f:
        f.truncate(10)
    assert find_resume_checkpoint(root, "exp", fallback=True) == old
    # The resumed run writes step 3 with keep=1: step 2 goes, step 3 stays, and the corrupt
    # step 4 (newer by name) neither counts against keep nor is taken for the newest.
    third = save_checkpoint(run, 3, _write_model, {"policy_version": 3}, keep=1)
    assert list_checkpoints(run) == [third, new]
    assert resume_checkpoint(run, fallback=True) == third
    # Reaching version 4 again replaces the corrupt one.
    fourth = save_checkpoint(run, 4, _write_model, {"policy_version": 4}, keep=1)
    assert list_checkpoints(run) == [fourth] and verify_checkpoint(fourth) == ""


# --- full disk ----------------------------------------------------------------------------------


class NativeWriteError(Exception):
    """What safetensors' Rust writer raises: not an OSError, the OS's text in its message."""


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        NativeWriteError(
            "Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
            'message: "No space left on device" })'
        ),
    ],
    ids=["oserror", "safetensors"],
)
def test_a_full_disk_names_the_checkpoint_the_dir_and_the_newest_complete_one(tmp_path, error):
    root, old, new = _two_checkpoints(tmp_path)
    run = os.path.dirname(new)

    def fills_the_disk(directory: str) -> None:
        _write_model(directory)
        raise error

    with pytest.raises(OSError) as full:
        save_checkpoint(run, 6, fills_the_disk, {"policy_version": 6}, keep=5)
    assert full.value.errno == errno.ENOSPC
    text = str(full.value)
    assert f"no space left on device writing checkpoint {run}/step_000006" in text
    assert f"checkpoint.dir={root}" in text
    assert f"the newest complete checkpoint is {new}" in text
    assert sorted(os.listdir(run)) == ["step_000002", "step_000004"]  # no staging left
    assert verify_checkpoint(new) == ""


def test_the_local_supervisor_restarts_roles_from_the_newest_checkpoint_that_verifies(
    small_config, workdir
):
    def supervisor(fallback: bool) -> Supervisor:
        checkpoint = {"dir": str(workdir / "ckpt"), "fallback_to_previous": fallback}
        return Supervisor(load_config(small_config(checkpoint=checkpoint)), old)

    run = str(workdir / "ckpt" / "t-20260101-000000-aaaa")
    state = {"run_id": "t-20260101-000000-aaaa"}
    old = save_checkpoint(run, 2, _write_model, {**state, "policy_version": 2}, keep=5)
    new = save_checkpoint(run, 4, _write_model, {**state, "policy_version": 4}, keep=5)
    assert supervisor(fallback=False)._newest_checkpoint() == new
    os.unlink(os.path.join(new, "model.safetensors"))
    with pytest.raises(CorruptCheckpoint, match=f"{new}/model.safetensors is missing"):
        supervisor(fallback=False)._newest_checkpoint()
    assert supervisor(fallback=True)._newest_checkpoint() == old
