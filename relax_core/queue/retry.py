"""How long a store keeps trying: quick retries on a transient fault, then, while the storage
stays unreachable (an object store restarting), a wait up to the outage limit.

The limit is the run's `storage.outage_limit_s`, set once per process (`set_outage_limit`) so
every store a role opens, the queue's and the checkpoints', waits the same. The threads waiting
on one root share one set of log lines (`OUTAGES`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

from relax_core.queue.errors import (
    StorageError,
    is_access_denied,
    is_missing_bucket,
    is_precondition_failed,
    is_transient,
)

log = logging.getLogger("relax_core.queue.store")

DEFAULT_OUTAGE_LIMIT_S = 600.0
_outage_limit_s = DEFAULT_OUTAGE_LIMIT_S
OUTAGE_NOTICE_S = 2.0
"""A fault that lasts this long is an outage (said in the log, and its end kept), not a blip."""
OUTAGE_LOG_EVERY_S = 10.0
"""While a store waits out an outage, it says so in the log this often."""


def set_outage_limit(seconds: float) -> None:
    """How long this process's stores wait for unreachable storage before giving up (the run's
    `storage.outage_limit_s`); stores whose RetryPolicy names its own limit keep theirs."""
    global _outage_limit_s
    if seconds < 0:
        raise ValueError(f"storage outage limit must be >= 0 s, got {seconds}")
    _outage_limit_s = float(seconds)


@dataclass(frozen=True)
class RetryPolicy:
    """Retries for transient storage faults, on top of the client's own (s3fs retries too)."""

    attempts: int = 4
    """Quick tries per operation, the first included."""
    base_delay_s: float = 0.1
    """Delay before the second try; doubles per try, with jitter."""
    max_delay_s: float = 2.0
    """Upper bound of one delay."""
    outage_limit_s: float | None = None
    """After the quick tries, keep trying this long from the first failure (the store is
    restarting); None = the process's setting (set_outage_limit), 0 = give up at once."""
    outage_poll_s: float = 2.0
    """Delay between tries while waiting out an outage."""

    def delay(self, attempt: int) -> float:
        return min(self.max_delay_s, self.base_delay_s * 2**attempt) * random.uniform(0.5, 1.0)

    def limit_s(self) -> float:
        return _outage_limit_s if self.outage_limit_s is None else self.outage_limit_s


class _Outages:
    """Which storage roots this process is waiting for, so that the threads waiting on one
    root (a role's work and its heartbeats) log one line when the wait starts, one every
    OUTAGE_LOG_EVERY_S, and one when the root answers again."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[str, list[float]] = {}  # root -> [since, last logged, waiters]

    def waiting(self, root: str, since: float, what: str, limit: float, err: Exception) -> None:
        now = time.monotonic()
        with self._lock:
            entry = self._waiting.get(root)
            if entry is None:
                self._waiting[root] = [since, now, 1]
                log.warning(
                    "storage at %s is unreachable (%s while %s); waiting up to %.0f s for it "
                    "(storage.outage_limit_s)",
                    root,
                    brief(err),
                    what,
                    limit,
                )
                return
            if now - entry[1] >= OUTAGE_LOG_EVERY_S:
                entry[1] = now
                log.warning(
                    "still waiting for storage at %s: unreachable for %.0f s of %.0f s (%s)",
                    root,
                    now - entry[0],
                    limit,
                    brief(err),
                )

    def join(self, root: str) -> None:
        with self._lock:
            entry = self._waiting.get(root)
            if entry is not None:
                entry[2] += 1

    def leave(self, root: str, recovered: bool) -> None:
        with self._lock:
            entry = self._waiting.get(root)
            if entry is None:
                return
            entry[2] -= 1
            if recovered:
                log.warning(
                    "storage at %s answers again after %.0f s", root, time.monotonic() - entry[0]
                )
                del self._waiting[root]
            elif entry[2] <= 0:
                del self._waiting[root]


OUTAGES = _Outages()


def brief(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def raise_unless_transient(err: Exception, what: str, url: str) -> None:
    """Re-raise what no retry can fix: a lost create race as it is, setup errors as a
    StorageError naming `url` and the fix; return for a transient fault."""
    if is_precondition_failed(err):
        raise err
    if is_access_denied(err):
        raise StorageError(
            f"access denied {what} {url}: check the credentials "
            "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or storage_options) and the "
            f"bucket policy ({err})"
        ) from err
    if is_missing_bucket(err):
        raise StorageError(
            f"the bucket of {url} does not exist: create it or fix the queue root"
        ) from err
    if not is_transient(err):
        raise err
