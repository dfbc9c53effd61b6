"""Prompt coverage (queue/coverage.py) on hand-built queues: from the tickets, the dataset's order,
the rows and the trainer's write-once step log, every prompt of the stream is trained once or
still queued; a missing, a twice-trained, a queued and an out-of-stream prompt are each found,
and a restarted trainer's steps trained again are not counted twice."""

from __future__ import annotations

import json

from relax_core.data import PromptSampler
from relax_core.queue import TransferQueue, rows_to_table
from relax_core.queue.admission import VOID
from relax_core.queue.coverage import (
    coverage_errors,
    read_prompt_coverage,
    record_step,
    surviving_steps,
)
from relax_core.queue.retention import PRUNED, summary_name

SIZE = 8  # prompts in the dataset
ORDER = PromptSampler(SIZE, seed=3).order


def _prompt(position: int) -> tuple[int, int]:
    return position // SIZE, int(ORDER(position // SIZE)[position % SIZE])


def _gid(position: int) -> str:
    epoch, index = _prompt(position)
    return f"e{epoch}-p{index}"


def _admit(queue: TransferQueue, first: int, count: int, stream_first: int | None = None) -> None:
    body = {"count": count, "policy_version": 0, "worker": "rollout-0", "time": 0.0}
    if stream_first is not None:
        body["stream_first"] = stream_first
    queue.store.create_if_absent(f"tickets/{first:020d}", json.dumps(body).encode())


def _commit(queue: TransferQueue, first: int, positions: list[int], ready: bool = True) -> None:
    """The rows of the block at ticket `first` (stream `positions`) in `rollout`, and in
    `ready` at the same seq (advantages keeps seqs)."""
    rows = [
        {
            "uid": f"{_gid(p)}-s{s}",
            "group_id": _gid(p),
            "epoch": _prompt(p)[0],
            "prompt_index": _prompt(p)[1],
            "behaviour_version_min": 0,
            "behaviour_version_max": 0,
            "reward": float(s),
        }
        for p in positions
        for s in range(2)
    ]
    seq = queue.put("rollout", rows_to_table(rows), {"tickets": [first, len(positions)]})
    if ready:
        queue.commit("ready", seq, rows_to_table(rows))


def _trainer(tmp_path) -> TransferQueue:
    """A trainer process's own handle on the queue (its own writer id)."""
    return TransferQueue(str(tmp_path), "run")


def _coverage(queue: TransferQueue) -> dict[str, int]:
    return read_prompt_coverage(queue, SIZE, ORDER)


def _clean_run(tmp_path) -> TransferQueue:
    """12 stream positions (over an epoch boundary) in blocks of 2; 4 steps of 2 groups trained
    (the trainer killed after step 3 and resumed from its checkpoint at step 2, training step 3
    again), positions 8..9 in `ready` untrained, 10..11 admitted and still being generated."""
    queue = TransferQueue(str(tmp_path), "run")
    for first in range(0, 12, 2):
        _admit(queue, first, 2)
    for first in range(0, 10, 2):
        _commit(queue, first, [first, first + 1])
    first_trainer, second_trainer = _trainer(tmp_path), _trainer(tmp_path)
    for step in (1, 2, 3):
        record_step(first_trainer, step, [_gid(2 * step - 2), _gid(2 * step - 1)])
    for step in (3, 4):
        record_step(second_trainer, step, [_gid(2 * step - 2), _gid(2 * step - 1)])
    return queue


def test_a_clean_run_covers_every_prompt_once_or_queued(tmp_path):
    counts = _coverage(_clean_run(tmp_path))
    assert counts["stream_prompts"] == 12
    assert counts["trained_once"] == 8  # steps 1, 2 of the first process, 3, 4 of the second
    assert counts["still_queued"] == 4  # 2 in `ready`, 2 being generated
    assert counts["missing"] == counts["trained_twice"] == counts["out_of_stream"] == 0
    assert counts["trained_steps"] == 4 and counts["missing_steps"] == 0
    assert coverage_errors(counts) == 0


def test_a_prompt_trained_twice_is_found(tmp_path):
    queue = _clean_run(tmp_path)
    # A third process resumes after step 4 with a cursor behind it: step 5 trains position 0.
    record_step(_trainer(tmp_path), 5, [_gid(0), _gid(8)])
    counts = _coverage(queue)
    assert counts["trained_twice"] == 1 and counts["trained_once"] == 8
    assert counts["still_queued"] == 3  # position 8 was trained
    assert coverage_errors(counts) == 1


def test_a_prompt_neither_trained_nor_queued_is_missing(tmp_path):
    queue = _clean_run(tmp_path)
    # Positions 8..9 reached `ready`, but step 5 trained only 8, and the rows of 9 are gone:
    # retention deleted the entry as if the trainer had consumed all of it.
    record_step(_trainer(tmp_path), 5, [_gid(8)])
    seq = queue.committed("ready")[-1]
    summary = {"stage": "rollout", "first": 0, "last": seq, "blocks": {"8": {"worker": "r"}}}
    queue.store.create_if_absent(
        f"{PRUNED}/rollout/{summary_name(0, seq)}", json.dumps(summary).encode()
    )
    for stage in ("rollout", "ready"):
        queue.store.delete(f"log/{stage}/{seq:020d}")
    counts = _coverage(queue)
    assert counts["missing"] == 1 and counts["trained_once"] == 9
    assert coverage_errors(counts) == 1


def test_stream_positions_no_block_issued_are_missing(tmp_path):
    queue = TransferQueue(str(tmp_path), "run")
    # Block 2..3 was voided by its worker's restart and nobody generated its prompts again.
    for first in (0, 2, 4):
        _admit(queue, first, 2)
    queue.store.create_if_absent(f"{VOID}/{2:020d}", b'{"count": 2, "policy_version": 0}')
    _commit(queue, 0, [0, 1])
    _commit(queue, 4, [4, 5])
    record_step(_trainer(tmp_path), 1, [_gid(0), _gid(1)])
    record_step(_trainer(tmp_path), 2, [_gid(4), _gid(5)])
    counts = _coverage(queue)
    assert counts["never_issued"] == 2 and counts["missing"] == 2
    assert counts["trained_once"] == 4 and counts["still_queued"] == 0
    # Redone in a later block (stream_first names the positions), they are covered again.
    _admit(queue, 6, 2, stream_first=2)
    _commit(queue, 6, [2, 3])
    counts = _coverage(queue)
    assert counts["never_issued"] == counts["missing"] == 0 and counts["still_queued"] == 2


def test_a_prompt_the_stream_never_issued_is_out_of_stream(tmp_path):
    queue = _clean_run(tmp_path)
    record_step(_trainer(tmp_path), 5, [_gid(8), _gid(40)])  # position 40: far past the end
    counts = _coverage(queue)
    assert counts["out_of_stream"] == 1 and coverage_errors(counts) == 1


def test_the_surviving_steps_follow_each_resume_back_to_the_process_it_resumed_from():
    def rec(version: int, writer: str, t: float) -> dict:
        return {"version": version, "writer": writer, "time": t, "groups": [f"{writer}{version}"]}

    # a trains 1..5 (checkpoint at 4) and dies; b resumes after 4, trains 5..7 and dies before
    # its checkpoint at 8; c resumes after 4 again and finishes at 8.
    records = [rec(v, "a", v) for v in range(1, 6)]
    records += [rec(v, "b", 10 + v) for v in (5, 6, 7)]
    records += [rec(v, "c", 20 + v) for v in (5, 6, 7, 8)]
    chain, missing = surviving_steps(records)
    assert {v: r["writer"] for v, r in chain.items()} == {
        1: "a",
        2: "a",
        3: "a",
        4: "a",
        5: "c",
        6: "c",
        7: "c",
        8: "c",
    }
    assert missing == []
    # Without a's record of step 2, the audit says so instead of guessing.
    chain, missing = surviving_steps([r for r in records if r["version"] != 2])
    assert missing == [2] and sorted(chain) == [1, 3, 4, 5, 6, 7, 8]
