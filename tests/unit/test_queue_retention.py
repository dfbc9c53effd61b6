"""Retention's decisions, on hand-built listings, records and checkpoint states: what every kept
checkpoint is past goes, the newest versions and each stage's newest entry stay, and a summary
keeps what the readers of deleted entries need (group counts, arrived versions, blocks)."""

from __future__ import annotations

import pytest

from relax_core.config import ConfigError, RunConfig, replace
from relax_core.queue.retention import (
    candidates,
    consumer_positions,
    covered,
    entry_version,
    leftovers,
    parse_summary_name,
    prune_bound,
    pruned_through,
    summarize,
    summary_name,
    totals,
)


def test_the_oldest_kept_checkpoint_decides_where_consumers_are():
    older = {"ready_cursor": {"through": 7}, "queue_cursors": {"rollout": 9, "ready": 8}}
    newer = {"ready_cursor": {"through": 12}, "queue_cursors": {"rollout": 14, "ready": 13}}
    # Async: the trainer's ready watermark covers every stage (derived stages keep the seq).
    assert consumer_positions([newer, older], "async") == {
        "rollout": 7,
        "ref": 7,
        "fwd": 7,
        "ready": 7,
    }
    # Colocate: each stage has its own cursor; a stage a run never used stays at -1.
    assert consumer_positions([older, newer], "colocate") == {
        "rollout": 9,
        "ref": -1,
        "fwd": -1,
        "ready": 8,
    }
    assert consumer_positions([], "async") == dict.fromkeys(("rollout", "ref", "fwd", "ready"), -1)


def test_candidates_are_past_the_consumers_above_what_is_pruned_and_never_the_newest():
    listed = [0, 1, 2, 3, 4, 5, 6]
    assert candidates(listed, done_through=1, position=4) == [2, 3, 4]
    # The consumers are past everything: the newest entry stays anyway, or a writer listing the
    # stage would number its next entry 0 again.
    assert candidates(listed, done_through=1, position=99) == [2, 3, 4, 5]
    assert candidates([], done_through=-1, position=10) == []
    assert candidates([3], done_through=-1, position=10) == []
    assert leftovers([2, 3, 9], done_through=3) == [2, 3]


def test_the_bound_stops_at_the_first_entry_of_a_version_still_kept():
    # newest checkpoint 10, keep_versions 2: versions <= 8 may go.
    versions = {4: 6, 5: 7, 6: None, 7: 9, 8: 5}
    assert prune_bound([4, 5, 6, 7, 8], versions, max_version=8, done_through=3) == 6
    # Seq 6 (a tombstone: no version) does not hold the prefix back; seq 7 (version 9) does, and
    # seq 8 behind it stays too: deletion is a prefix, so "was s pruned" is a comparison.
    assert prune_bound([], versions, max_version=8, done_through=3) == 3
    assert prune_bound([7, 8], versions, max_version=8, done_through=6) == 6


def test_entry_version_is_the_newest_generating_version():
    assert entry_version({"versions": {"3": 2, "5": 1}}) == 5
    assert entry_version({"versions": {}, "meta": {"policy_version": 4}}) == 4
    assert entry_version({"payload": None, "tombstone": "quarantined", "versions": {}}) is None
    assert entry_version(None) is None


def test_a_summary_keeps_counts_arrived_versions_blocks_and_payloads():
    headers = {
        4: {
            "payload": "inline",
            "rows": 8,
            "groups": 2,
            "bytes": 100,
            "versions": {"3": 2},
            "meta": {"tickets": [8, 2], "worker": "rollout-1", "dropped": ["g9"]},
        },
        5: {
            "payload": "data/rollout/abc.arrow",
            "rows": 4,
            "groups": 1,
            "bytes": 900,
            "versions": {"4": 1},
            "meta": {"tickets": [10, 1], "worker": "rollout-0"},
        },
        6: None,  # an unreadable record
    }
    s = summarize("rollout", 4, 6, headers)
    assert (s["first"], s["last"], s["entries"]) == (4, 6, 3)
    assert (s["rows"], s["groups"], s["bytes"], s["unreadable"]) == (12, 3, 1000, 1)
    assert s["versions"] == {"3": 2, "4": 1}
    assert s["blocks"] == {
        "8": {"worker": "rollout-1", "dropped": ["g9"]},
        "10": {"worker": "rollout-0"},
    }
    assert s["payloads"] == ["data/rollout/abc.arrow"]

    # A ready tombstone stands for a quarantined rollout entry: its groups count as arrived
    # (the trainer stops waiting for them) from the rollout record of the same seq.
    ready = {
        4: {"payload": "inline", "rows": 8, "groups": 2, "versions": {"3": 2}},
        5: {"payload": None, "tombstone": "rollout quarantined", "rows": 0, "versions": {}},
    }
    r = summarize("ready", 4, 5, ready, fallback=headers)
    assert r["versions"] == {"3": 2, "4": 1} and r["tombstones"] == 1 and r["groups"] == 2
    assert "blocks" not in r and r["payloads"] == []


def test_summary_names_ranges_and_totals():
    name = summary_name(3, 17)
    assert name == "00000000000000000003-00000000000000000017"
    assert parse_summary_name(name) == (3, 17)
    assert parse_summary_name("00000000000000000017-00000000000000000003") is None
    assert parse_summary_name(".tmp-x") is None
    ranges = [(0, 3), (4, 9)]
    assert covered(ranges, 9) and not covered(ranges, 10)
    assert pruned_through(ranges) == 9 and pruned_through([]) == -1
    got = totals([{"entries": 2, "groups": 4, "rows": 16, "last": 3}, {"entries": 1, "last": 9}])
    assert got == {"entries": 3, "groups": 4, "rows": 16, "through": 9}


def test_retention_settings_are_checked_with_their_allowed_values():
    assert RunConfig().queue.retention == "prune"
    with pytest.raises(ConfigError, match=r"queue.retention: 'forever' is not one of prune, keep"):
        replace(RunConfig(), queue={"retention": "forever"})
    with pytest.raises(ConfigError, match=r"queue.keep_versions: must be >= 0, got -1"):
        replace(RunConfig(), queue={"keep_versions": -1})
