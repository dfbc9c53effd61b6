"""TransferQueue: the Arrow row schema and the commit-log data bus between roles, on any fsspec
storage: commits, claims (leases), staleness admission, quarantine, `relax queue`'s inspection
(inspect.py), the exactly-once audit of a finished run (audit.py) and retention: which consumed
entries may be deleted (retention.py, pure) and their deletion (pruning.py).

May import: config.
"""

from relax_core.queue.admission import (
    AdmissionLedger,
    admissible,
    admission_limit,
    may_start_group,
    select_step_groups,
    split_over_stale,
    staleness_histogram,
)
from relax_core.queue.claims import Lease, StageWorker
from relax_core.queue.cursor import StageCursor
from relax_core.queue.errors import StorageError, StorageUnavailable
from relax_core.queue.open import check_queue_storage, open_queue
from relax_core.queue.queue import STAGES, Entry, TransferQueue
from relax_core.queue.record import CorruptEntry
from relax_core.queue.schema import (
    ROW_SCHEMA,
    SCHEMA_VERSION,
    check_whole_groups,
    rows_to_table,
    table_to_rows,
    validate_table,
    with_columns,
)
from relax_core.queue.store import ObjectStore, RetryPolicy

__all__ = [
    "ROW_SCHEMA",
    "SCHEMA_VERSION",
    "STAGES",
    "AdmissionLedger",
    "CorruptEntry",
    "Entry",
    "Lease",
    "ObjectStore",
    "RetryPolicy",
    "StageCursor",
    "StageWorker",
    "StorageError",
    "StorageUnavailable",
    "TransferQueue",
    "admissible",
    "admission_limit",
    "check_queue_storage",
    "check_whole_groups",
    "may_start_group",
    "open_queue",
    "rows_to_table",
    "select_step_groups",
    "split_over_stale",
    "staleness_histogram",
    "table_to_rows",
    "validate_table",
    "with_columns",
]
