"""Commit records: a JSON header line, then (for an inline entry) the Arrow IPC payload bytes.

A record names where its rows are: `"payload": "data/{stage}/{uuid}.arrow"` for a separate
immutable object, `"inline"` when the payload follows the header inside the record itself (one
object per entry: one request to commit, one to read), or null for a tombstone. Small entries
go inline; large ones keep their own object, whose transfer time dwarfs the extra request.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

INLINE = "inline"


class CorruptEntry(ValueError):
    """A committed entry whose record or payload cannot be used (truncated, wrong schema...)."""


def encode_record(record: dict[str, Any], inline: bytes | None = None) -> bytes:
    header = json.dumps(record, separators=(",", ":")).encode()  # never contains a newline
    return header if inline is None else header + b"\n" + inline


def decode_header(raw: bytes, where: str) -> tuple[dict[str, Any], int]:
    """(record, offset of the inline payload) from the first bytes of a record object."""
    newline = raw.find(b"\n")
    head = raw if newline < 0 else raw[:newline]
    try:
        record = json.loads(head)
    except ValueError as err:
        raise CorruptEntry(f"corrupt commit record {where}: {err}") from err
    if not isinstance(record, dict) or "payload" not in record:
        raise CorruptEntry(f"corrupt commit record {where}: no 'payload' field")
    payload = record["payload"]
    if payload is None and not record.get("tombstone"):
        raise CorruptEntry(f"commit record {where} names no payload")
    if payload is not None and not isinstance(payload, str):
        raise CorruptEntry(f"corrupt commit record {where}: bad 'payload'")
    return record, (len(raw) if newline < 0 else newline + 1)


def decode_record(raw: bytes, where: str) -> tuple[dict[str, Any], bytes | None]:
    """(record, inline payload bytes or None); CorruptEntry if the two do not agree."""
    record, offset = decode_header(raw, where)
    if record["payload"] != INLINE:
        return record, None
    inline = raw[offset:]
    if len(inline) != record.get("bytes"):
        raise CorruptEntry(
            f"commit record {where} holds {len(inline)} payload bytes but says {record.get('bytes')}"
        )
    return record, inline


def version_counts(table: pa.Table) -> dict[str, int]:
    """Groups per behaviour_version_min (the oldest weights that produced any token of a group).

    Plain Python over two columns: entries hold tens to hundreds of rows, where a pyarrow
    compute call's fixed cost is larger than the loop.
    """
    oldest: dict[str, int] = {}
    groups = table.column("group_id").to_pylist()
    versions = table.column("behaviour_version_min").to_pylist()
    for group, version in zip(groups, versions, strict=True):
        v = -1 if version is None else version
        if group not in oldest or v < oldest[group]:
            oldest[group] = v
    counts: dict[str, int] = {}
    for v in oldest.values():
        counts[str(v)] = counts.get(str(v), 0) + 1
    return counts


def admitted_counts(record: dict[str, Any] | None) -> dict[str, int]:
    """Groups of an entry per the policy version the rollout admitted them under (the in-flight
    accounting's unit: admission tickets carry that version). A block's groups share it; their
    rows may carry a newer behaviour version (a server that started them only after a weight
    update, as vLLM does for requests a pause held back). Records without it (older writers,
    other stages' own entries) count by `versions`, the behaviour versions."""
    if not record:
        return {}
    admitted = (record.get("meta") or {}).get("admitted_version")
    if admitted is not None and record.get("groups"):
        return {str(int(admitted)): int(record["groups"])}
    return dict(record.get("versions") or {})
