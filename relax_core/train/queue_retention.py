"""After a checkpoint, delete the queue entries that no kept checkpoint can need again.

The consumers' durable positions are in the kept checkpoints' state.json files, read here;
queue/retention.py decides what may go and queue/pruning.py deletes it. The async trainer calls
this after each checkpoint it writes, and the colocate controller after each of its own, so one
process prunes a run. `queue.retention: keep` turns it off.
"""

from __future__ import annotations

import logging

from relax_core.config import RunConfig
from relax_core.queue import StorageError, TransferQueue
from relax_core.queue.pruning import prune
from relax_core.queue.retention import consumer_positions
from relax_core.train import checkpoint as ckpt

log = logging.getLogger(__name__)


def prune_queue(queue: TransferQueue, cfg: RunConfig, run_dir: str) -> dict | None:
    """Prune `queue` by the checkpoints kept under `run_dir`; returns what went per stage (None:
    retention is 'keep', no checkpoint, or storage failed).

    A storage failure costs only the pass: it is logged, and the next checkpoint's pass
    finishes the work, so housekeeping never stops training.
    """
    if cfg.queue.retention != "prune":
        return None
    options = cfg.storage.options()
    try:
        states = [ckpt.read_state(p, options) for p in ckpt.list_checkpoints(run_dir, options)]
        if not states:
            return None
        newest = max(int(s["policy_version"]) for s in states)
        report = prune(
            queue,
            consumer_positions(states, cfg.mode),
            newest,
            cfg.queue.keep_versions,
            aligned=cfg.mode == "async",
        )
    except (OSError, StorageError) as err:
        log.warning("queue retention skipped (the next checkpoint tries again): %s", err)
        return None
    gone = sum(r["entries"] for r in report.values())
    if gone:
        log.info("queue retention: deleted %d entries (%s)", gone, report)
    return report
