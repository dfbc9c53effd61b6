"""Open a run's queue from its config section, and the start-up check of the storage behind it."""

from __future__ import annotations

import uuid

from relax_core.config import QueueConfig
from relax_core.queue.queue import TransferQueue
from relax_core.queue.store import ObjectStore, RetryPolicy, probe_create_if_absent


def open_queue(
    cfg: QueueConfig, run_id: str, *, multi_writer: bool = True, durable: bool = True
) -> TransferQueue:
    """`durable=False`: no fsync on local disk (writes survive a crash of the process, not of
    the machine)."""
    return TransferQueue(
        cfg.root,
        run_id,
        cfg.storage_options(),
        durable=durable,
        multi_writer=multi_writer,
        retry=RetryPolicy(attempts=cfg.retry_attempts),
    )


def check_queue_storage(cfg: QueueConfig, multi_writer: bool = False) -> None:
    """Before a run starts: the root is reachable and writable with these credentials, and (for
    several writers) enforces create-if-absent. Raises StorageError/RuntimeError naming the root."""
    # A fresh client: fsspec reuses instances with equal options, which would keep credentials
    # read before the environment changed.
    options = {**cfg.storage_options(), "skip_instance_cache": True}
    # Fails fast: a run that cannot reach its storage at start is a setup error, not an outage.
    store = ObjectStore(cfg.root, options, retry=RetryPolicy(attempts=2, outage_limit_s=0))
    store.check_access(f".relax-probe-{uuid.uuid4().hex}")
    probe = f".relax-probe-{uuid.uuid4().hex}"
    if multi_writer and not store.is_local and not probe_create_if_absent(store, probe):
        raise RuntimeError(
            f"storage at {store.url('')} does not enforce create-if-absent "
            "(If-None-Match: *); several writers per stage need it"
        )
