"""Checkpoints are all-or-nothing, pruned to the newest few, and found again by run name."""

from __future__ import annotations

import os

import pytest
import torch

from relax_core.train.checkpoint import (
    decode_rng,
    encode_rng,
    find_resume_checkpoint,
    list_checkpoints,
    read_state,
    save_checkpoint,
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
