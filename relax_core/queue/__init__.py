"""TransferQueue: the Arrow row schema and the commit-log data bus between roles."""

from relax_core.queue.queue import STAGES, TransferQueue
from relax_core.queue.schema import (
    ROW_SCHEMA,
    SCHEMA_VERSION,
    check_whole_groups,
    rows_to_table,
    table_to_rows,
    validate_table,
    with_columns,
)
from relax_core.queue.store import ObjectStore

__all__ = [
    "ROW_SCHEMA",
    "SCHEMA_VERSION",
    "STAGES",
    "ObjectStore",
    "TransferQueue",
    "check_whole_groups",
    "rows_to_table",
    "table_to_rows",
    "validate_table",
    "with_columns",
]
