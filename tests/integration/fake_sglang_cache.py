"""The stand-in SGLang server's prefix (radix) cache and its flush, as far as a client can tell.

Rules copied from SGLang 0.5.23 (facts, not code):
- every finished request leaves its tokens (prompt + output) in the radix cache, and a new
  request reuses the KV of the longest cached prefix of its prompt (`meta_info.cached_tokens`);
  the cache does not know which weights computed that KV: a weight update that does not flush
  leaves it to be served under the new weights (srt/mem_cache/radix_cache.py);
- the cache is emptied by `/flush_cache` (http_server.flush_cache -> Scheduler.flush_cache),
  by a weight update with `flush_cache` (flush_cache_after_weight_update) and by releasing the
  KV cache's memory; a flush runs only on a fully idle scheduler (is_fully_idle, waiting
  requests ignored while generation is paused), else it fails with HTTP 400;
- `/flush_cache?timeout=T` (T > 0) on a busy scheduler is deferred: it runs as soon as the
  scheduler is idle (checked after each loop iteration: SchedulerFlushWrapper.check_pending),
  or fails "Timed out waiting for idle state." after T seconds; a second one while one is
  pending fails "Another flush_cache is already in progress.".

Here each cached sequence keeps the weights version that computed it (its first token's), so
a request served KV of older weights is recorded as a `stale_kv` event (`GET
/relax_test/events`): what a user would see as rollout log-probs (and, for an MoE policy, routed
experts) that the weights the server reports did not produce.
"""

from __future__ import annotations

import time

MAX_ENTRIES = 512

FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
    "waiting requests, the operation will not be performed.)\n"
)


class PrefixCache:
    """Cached token sequences and the weights version that computed each."""

    def __init__(self) -> None:
        self.entries: dict[tuple[int, ...], str] = {}

    def match(self, prompt: list[int]) -> tuple[int, str | None]:
        """(cached tokens, the version that computed them) of the longest cached prefix of
        `prompt`; at least its last token is computed anew."""
        best, version = 0, None
        for seq, v in self.entries.items():
            n = 0
            for a, b in zip(seq, prompt[:-1], strict=False):
                if a != b:
                    break
                n += 1
            if n > best:
                best, version = n, v
        return best, version

    def insert(self, tokens: list[int], version: str) -> None:
        self.entries.pop(tuple(tokens), None)
        self.entries[tuple(tokens)] = version
        while len(self.entries) > MAX_ENTRIES:
            self.entries.pop(next(iter(self.entries)))

    def reset(self) -> None:
        self.entries.clear()


class Flusher:
    """`/flush_cache` of one stand-in server (`scheduler`: FakeSGLang, whose `cond` guards it)."""

    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler
        self.pending = False
        self.done = 0
        """Deferred flushes that ran (wakes their callers)."""

    def flush(self, timeout_s: float) -> tuple[bool, str]:
        """(success, the answer's text)."""
        s = self.scheduler
        with s.cond:
            if self.pending:
                return False, "Another flush_cache is already in progress."
            if timeout_s <= 0 or s.idle_for_flush():
                return self._now()
            self.pending, deadline, ticket = True, time.monotonic() + timeout_s, self.done
            while self.done == ticket:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.pending = False
                    return False, "Timed out waiting for idle state."
                s.cond.wait(left)
            return True, FLUSHED

    def check_pending(self) -> None:
        """Under the scheduler's cond, where its loop has just made progress."""
        if self.pending and self.scheduler.idle_for_flush():
            self._now()
            self.pending = False
            self.done += 1
            self.scheduler.cond.notify_all()

    def _now(self) -> tuple[bool, str]:
        s = self.scheduler
        if not s.idle_for_flush():
            return False, "Flush cache failed.\n"
        s.cache.reset()
        s.event("flush")
        return True, FLUSHED
