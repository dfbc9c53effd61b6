"""TransferQueue: row schema conversions and the commit log on local and in-memory storage."""

from __future__ import annotations

import json
import os
import threading

import fsspec
import pyarrow as pa
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from relax_core.queue import (
    ROW_SCHEMA,
    STAGES,
    TransferQueue,
    check_whole_groups,
    rows_to_table,
    table_to_rows,
    validate_table,
    with_columns,
)
from relax_core.queue.store import ObjectStore


def _full_row() -> dict:
    # Floats are exact in float32 (powers of two), so the round trip can compare with ==.
    return {
        "uid": "g0-0",
        "group_id": "g0",
        "prompt_index": 7,
        "epoch": 2,
        "prompt_ids": [1, 2, 3],
        "response_ids": [4, 5],
        "loss_mask": [1, 0],
        "rollout_logprobs": [-0.5, -0.25],
        "reward": 1.0,
        "reward_info": '{"correct": true}',
        "finish_reason": "stop",
        "behaviour_version_min": 3,
        "behaviour_version_max": 4,
        "turns": 2,
        "media": [
            {"kind": "image", "uri": "s3://b/cat.png", "bytes": None},
            {"kind": "audio", "uri": None, "bytes": b"\x00\x01RIFF"},
        ],
        "ref_logprobs": [-0.75, -0.125],
        "old_logprobs": [-0.5, -0.25],
        "advantages": [0.5, 0.5],
        "teacher_logprobs": [-1.0, -2.0],
        "routed_experts": [[0, 3], [1, 2]],
    }


def _group_rows(n_groups: int, group_size: int, tag: str = "") -> list[dict]:
    return [
        {
            "uid": f"{tag}g{g}-{i}",
            "group_id": f"{tag}g{g}",
            "response_ids": [g, i],
            "finish_reason": "length",
        }
        for g in range(n_groups)
        for i in range(group_size)
    ]


# --- schema -------------------------------------------------------------------------------------


def test_round_trip_keeps_every_column_and_nulls() -> None:
    sparse = {"uid": "g0-1", "group_id": "g0"}
    table = rows_to_table([_full_row(), sparse])
    assert table.schema.names == ROW_SCHEMA.names
    assert table.schema.metadata == ROW_SCHEMA.metadata
    back = table_to_rows(table)
    assert back[0] == _full_row()
    expected_sparse = {name: None for name in ROW_SCHEMA.names} | sparse
    assert back[1] == expected_sparse


def test_reward_info_dict_is_stored_as_json_text() -> None:
    table = rows_to_table([{"uid": "a", "group_id": "g", "reward_info": {"acc": 1}}])
    assert json.loads(table_to_rows(table)[0]["reward_info"]) == {"acc": 1}


@pytest.mark.parametrize(
    ("bad_row", "expected"),
    [
        ({"response_ids": [1, "x"]}, "column 'response_ids', row 1"),
        # pyarrow alone would silently truncate 0.5 to token id 0.
        ({"prompt_ids": [0.5, 2.0]}, "column 'prompt_ids', row 1"),
        ({"reward": "high"}, "column 'reward', row 1"),
        ({"epoch": True}, "column 'epoch', row 1"),
        ({"loss_mask": [300]}, "column 'loss_mask', row 1"),
        ({"finish_reason": "eos"}, "column 'finish_reason', row 1"),
        ({"reward_info": "{not json"}, "column 'reward_info', row 1"),
        ({"group_id": None}, "row 1: required column 'group_id'"),
        # The trainer reads token lists' values straight into tensors: no null token.
        ({"response_ids": [1, None]}, "column 'response_ids', row 1: a null inside the list"),
        ({"advantages": [0.5, None]}, "column 'advantages', row 1: a null inside the list"),
        ({"respons_ids": [1]}, "row 1: unknown column(s) ['respons_ids']"),
    ],
)
def test_bad_value_error_names_column_and_row(bad_row: dict, expected: str) -> None:
    rows = [{"uid": "a", "group_id": "g"}, {"uid": "b", "group_id": "g"} | bad_row]
    with pytest.raises(ValueError) as info:
        rows_to_table(rows)
    assert expected in str(info.value)


def test_a_null_token_is_refused_on_read_but_not_for_rows_sliced_off() -> None:
    good = rows_to_table(_group_rows(1, 2))
    ids = pa.array([[1, None], [0, 1]], pa.list_(pa.int32()))
    bad = good.set_column(good.schema.get_field_index("response_ids"), "response_ids", ids)
    with pytest.raises(ValueError, match="'response_ids', row 0: a null inside the list"):
        validate_table(bad)
    assert validate_table(bad.slice(1)).num_rows == 1  # the null is in the row left out


def test_with_columns_replaces_values_and_keeps_schema() -> None:
    table = rows_to_table(_group_rows(1, 2))
    out = with_columns(table, advantages=[[0.5, -0.5], [1.0, 0.0]], reward=[1, 0])
    assert out.schema.equals(ROW_SCHEMA, check_metadata=True)
    rows = table_to_rows(out)
    assert [r["advantages"] for r in rows] == [[0.5, -0.5], [1.0, 0.0]]
    assert [r["reward"] for r in rows] == [1.0, 0.0]
    assert [r["response_ids"] for r in rows] == [[0, 0], [0, 1]]
    assert table_to_rows(table)[0]["advantages"] is None  # the input is not modified


def test_with_columns_rejects_wrong_length_name_and_type() -> None:
    table = rows_to_table(_group_rows(1, 2))
    with pytest.raises(ValueError, match="'advantages': got 1 values for a table of 2 rows"):
        with_columns(table, advantages=[[0.5]])
    with pytest.raises(ValueError, match="unknown column 'advantage'"):
        with_columns(table, advantage=[[0.5], [0.5]])
    with pytest.raises(ValueError, match="column 'old_logprobs', row 0"):
        with_columns(table, old_logprobs=[["a"], [0.5]])


def test_validate_table_names_missing_extra_and_mistyped_columns() -> None:
    table = rows_to_table(_group_rows(1, 2))
    broken = (
        table.drop_columns(["turns"])
        .append_column("score", pa.array([1, 2]))
        .set_column(
            ROW_SCHEMA.get_field_index("reward"), "reward", pa.array([1.0, 2.0], pa.float64())
        )
    )
    with pytest.raises(ValueError) as info:
        validate_table(broken)
    message = str(info.value)
    assert "missing columns ['turns']" in message
    assert "extra columns ['score']" in message
    assert "reward (double, expected float)" in message


def test_validate_table_restores_column_order() -> None:
    table = rows_to_table(_group_rows(1, 2))
    shuffled = table.select(list(reversed(table.column_names)))
    assert validate_table(shuffled).schema.names == ROW_SCHEMA.names


def test_check_whole_groups() -> None:
    check_whole_groups(rows_to_table(_group_rows(3, 4)), group_size=4)
    split = rows_to_table(_group_rows(3, 4)[:-1])  # g2 lost its last sample
    with pytest.raises(ValueError, match="1 group\\(s\\) are not whole.*'g2' has 3"):
        check_whole_groups(split, group_size=4)


# --- store --------------------------------------------------------------------------------------


def test_create_if_absent_creates_once_and_keeps_first_content(tmp_path) -> None:
    store = ObjectStore(str(tmp_path))
    assert store.create_if_absent("log/x/1", b"first") is True
    assert store.create_if_absent("log/x/1", b"second") is False
    assert store.read_bytes("log/x/1") == b"first"
    assert os.listdir(tmp_path / "log" / "x") == ["1"]  # no temp files left behind
    assert store.list_dir("log/x") == ["1"]
    assert store.list_dir("log/none") == []
    assert store.exists("log/x/1") and not store.exists("log/x/2")


def test_read_of_missing_object_names_it(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="no object at .*data/a.arrow"):
        ObjectStore(str(tmp_path)).read_bytes("data/a.arrow")


# --- queue --------------------------------------------------------------------------------------


def test_put_read_next_committed_in_order(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run1")
    tables = [rows_to_table(_group_rows(2, 2, tag=f"b{b}")) for b in range(3)]
    seqs = [queue.put("rollout", t, meta={"policy_version": i}) for i, t in enumerate(tables)]
    assert seqs == [0, 1, 2]
    assert queue.committed("rollout") == [0, 1, 2]
    assert queue.committed("rollout", after=0) == [1, 2]
    assert queue.committed("ready") == []
    assert queue.depth("rollout", cursor=0) == 2
    seq, got = queue.next("rollout", cursor=0)
    assert seq == 1 and got.equals(tables[1])
    assert queue.next("rollout", cursor=2) is None
    assert queue.read("rollout", 2).equals(tables[2])
    record = queue.record("rollout", 2)
    assert (record["rows"], record["groups"], record["meta"]) == (4, 2, {"policy_version": 2})
    assert (tmp_path / "run1" / "log" / "rollout" / f"{2:020d}").is_file()


def test_unknown_stage_lists_the_stages(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run1")
    with pytest.raises(ValueError, match="unknown queue stage 'train'.*'rollout', 'ref'"):
        queue.put("train", rows_to_table(_group_rows(1, 1)))
    assert STAGES == ("rollout", "ref", "fwd", "ready")


def _uids_through_log(queue: TransferQueue, stage: str) -> list[str]:
    uids, cursor = [], -1
    while (item := queue.next(stage, cursor)) is not None:
        cursor, table = item
        uids += table.column("uid").to_pylist()
    return uids


def test_two_writers_interleaved_lose_no_record(tmp_path) -> None:
    a = TransferQueue(str(tmp_path), "run", durable=False)
    b = TransferQueue(str(tmp_path), "run", durable=False)
    # Each writer's cached next seq goes stale as soon as the other commits.
    got = []
    for i in range(3):
        got.append(a.put("ref", rows_to_table(_group_rows(1, 1, tag=f"a{i}"))))
        got.append(b.put("ref", rows_to_table(_group_rows(1, 1, tag=f"b{i}"))))
    assert got == [0, 1, 2, 3, 4, 5]
    uids = _uids_through_log(TransferQueue(str(tmp_path), "run"), "ref")
    assert uids == ["a0g0-0", "b0g0-0", "a1g0-0", "b1g0-0", "a2g0-0", "b2g0-0"]


def test_two_writers_racing_in_threads_lose_no_record(tmp_path) -> None:
    writers = [TransferQueue(str(tmp_path), "run") for _ in range(2)]
    seqs: list[list[int]] = [[], []]

    def write(w: int) -> None:
        for i in range(8):
            seqs[w].append(writers[w].put("fwd", rows_to_table(_group_rows(1, 1, f"w{w}-{i}-"))))

    threads = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(seqs[0] + seqs[1]) == list(range(16))
    uids = _uids_through_log(writers[0], "fwd")
    assert sorted(uids) == sorted(f"w{w}-{i}-g0-0" for w in range(2) for i in range(8))
    for w in range(2):  # each writer's own puts stay in its order
        assert [u for u in uids if u.startswith(f"w{w}-")] == [f"w{w}-{i}-g0-0" for i in range(8)]


def test_small_entries_travel_inside_their_record_and_large_ones_in_their_own_object(
    tmp_path,
) -> None:
    table = rows_to_table(_group_rows(2, 4))
    small = TransferQueue(str(tmp_path), "small")
    small.put("ready", table)
    assert small.record("ready", 0)["payload"] == "inline"
    assert not (tmp_path / "small" / "data").exists()
    large = TransferQueue(str(tmp_path), "large", inline_max_bytes=100)
    large.put("ready", table)
    payload = large.record("ready", 0)["payload"]
    assert payload.startswith("data/ready/") and (tmp_path / "large" / payload).is_file()
    assert small.read("ready", 0).equals(table) and large.read("ready", 0).equals(table)


def test_truncated_payload_raises_error_naming_the_object(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    queue.put("ready", rows_to_table(_group_rows(2, 4)))
    payload = tmp_path / "run" / queue.record("ready", 0)["payload"]
    payload.write_bytes(payload.read_bytes()[: payload.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"corrupt or truncated queue payload .*{payload.name}"):
        queue.read("ready", 0)


def test_truncated_inline_record_raises_error_naming_it(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    queue.put("ready", rows_to_table(_group_rows(2, 4)))
    record = tmp_path / "run" / "log" / "ready" / f"{0:020d}"
    record.write_bytes(record.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"commit record .*{record.name} holds .* payload bytes"):
        queue.read("ready", 0)


def test_log_record_is_committed_only_after_its_payload_is_complete(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)
    table = rows_to_table(_group_rows(2, 2))
    original_create = queue.store.create_if_absent
    seen = []

    def checking_create(path: str, data: bytes) -> bool:
        payload = json.loads(data)["payload"]
        # At commit time the payload must already be readable in full.
        seen.append(path)
        assert pa.ipc.open_file(queue.store.full_path(payload)).read_all().equals(table)
        return original_create(path, data)

    queue.store.create_if_absent = checking_create
    assert queue.put("rollout", table) == 0
    assert seen == [f"log/rollout/{0:020d}"]


def test_failed_payload_write_leaves_nothing_visible(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run", inline_max_bytes=0)

    def failing_write(path: str, data: bytes) -> None:
        raise OSError("disk full")

    queue.store.write_immutable = failing_write
    with pytest.raises(OSError, match="disk full"):
        queue.put("rollout", rows_to_table(_group_rows(1, 2)))
    assert queue.committed("rollout") == []
    assert queue.next("rollout", -1) is None


def test_put_rejects_bad_table_and_meta_before_writing(tmp_path) -> None:
    queue = TransferQueue(str(tmp_path), "run")
    table = rows_to_table(_group_rows(1, 2))
    with pytest.raises(ValueError, match="missing columns \\['turns'\\]"):
        queue.put("rollout", table.drop_columns(["turns"]))
    with pytest.raises(ValueError, match="meta must be JSON-serializable"):
        queue.put("rollout", table, meta={"when": object()})
    assert not (tmp_path / "run" / "data").exists()


def test_stop_and_heartbeat_are_seen_by_other_queue_objects(tmp_path) -> None:
    writer, watcher = TransferQueue(str(tmp_path), "run"), TransferQueue(str(tmp_path), "run")
    assert not watcher.stopped()
    writer.heartbeat("rollout", "0", {"step": 1})
    writer.heartbeat("rollout", "0", {"step": 2})  # overwrites
    beat = json.loads(watcher.store.read_bytes("control/heartbeats/rollout-0"))
    assert (beat["role"], beat["worker_id"], beat["info"]) == ("rollout", "0", {"step": 2})
    writer.stop()
    writer.stop()  # idempotent
    assert watcher.stopped()


class _IgnoresConditionFS(MemoryFileSystem):
    """In-memory storage that accepts an exclusive create over an existing object, as S3
    servers without If-None-Match support do."""

    protocol = "memory-nocondition"

    def _open(self, path, mode="rb", **kwargs):
        return super()._open(path, mode.replace("x", "w"), **kwargs)


fsspec.register_implementation("memory-nocondition", _IgnoresConditionFS, clobber=True)


def test_storage_that_ignores_create_if_absent_is_refused_for_multiple_writers(caplog) -> None:
    queue = TransferQueue("memory-nocondition://q1", "run")
    with pytest.raises(RuntimeError, match="does not enforce create-if-absent.*multi_writer=False"):
        queue.put("rollout", rows_to_table(_group_rows(1, 1)))
    assert queue.committed("rollout") == []
    single = TransferQueue("memory-nocondition://q1", "run", multi_writer=False)
    assert single.probe() is False
    assert "single-writer mode only" in caplog.text
    assert single.put("rollout", rows_to_table(_group_rows(1, 1))) == 0


def test_fsspec_backend_without_local_disk_round_trips() -> None:
    # memory:// takes the non-local branch: exclusive open ("xb") instead of link(2).
    queue = TransferQueue("memory://relax-queue-test2", "run")
    table = rows_to_table(_group_rows(2, 2))
    assert [queue.put("ref", table), queue.put("ref", table)] == [0, 1]
    assert queue.store.create_if_absent("log/ref/00000000000000000001", b"{}") is False
    seq, got = queue.next("ref", 0)
    assert seq == 1 and got.equals(table)
