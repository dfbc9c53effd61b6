"""Arrow IPC (file format, zstd) encoding of row tables; decoding never trusts the bytes."""

from __future__ import annotations

import pyarrow as pa

_WRITE_OPTIONS = pa.ipc.IpcWriteOptions(compression="zstd")


def encode_table(table: pa.Table) -> bytes:
    """Serialize `table` as one Arrow IPC file with zstd-compressed buffers."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema, options=_WRITE_OPTIONS) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_table(data: bytes, source: str) -> pa.Table:
    """Parse Arrow IPC file bytes; a truncated or corrupt payload raises ValueError naming `source`."""
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data))
        table = reader.read_all()
        # Buffers are only checked lazily; a full validation turns bit rot into an error here
        # instead of a crash or garbage deep inside a loss function.
        table.validate(full=True)
    except (pa.ArrowException, OSError) as err:
        raise ValueError(
            f"corrupt or truncated queue payload {source} ({len(data)} bytes): {err}"
        ) from err
    return table
