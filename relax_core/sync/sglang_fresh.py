"""What keeps SGLang servers serving the weights the trainer sent, beside the update itself (used
by sync/sglang.py, each step over every server at once):

- `flush_idle`: after an update paused in place, SGLang's radix cache still holds KV (and an MoE
  policy's routing) computed by the older weights, and new requests reuse it. `/flush_cache`
  runs only on an idle scheduler: it runs at once where nothing was running, and answers HTTP
  400 where requests were paused in place (they keep running after continue).
- `PendingFlushes`: for those servers, `/flush_cache?timeout=T` after continue, which SGLang
  0.5.23 defers until the scheduler is idle (SchedulerFlushWrapper), i.e. once the requests that
  kept running have finished, in the same loop iteration. The calls block until then, so they
  run on threads of their own and the trainer does not wait; a failure is logged at the next
  update. One still pending covers a later update too (it flushes after that one's load).
- `restarted`: a server that no longer reports the version last sent to it (`/model_info`
  weight_version) was restarted at its URL, holds no weight group and would fail the next
  broadcast: the group is formed again before the update.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from relax_core.rollout.sglang_engine import SGLangClient, SGLangError

log = logging.getLogger(__name__)

Clients = dict[str, SGLangClient]
"""The servers by engine name."""


def flush_idle(pool: ThreadPoolExecutor, clients: Clients) -> list[str]:
    """Flush every server's cache now; the names of those that were busy (HTTP 400)."""
    futures = {
        name: pool.submit(client.post, "/flush_cache", {}) for name, client in clients.items()
    }
    busy = []
    for name, future in futures.items():
        try:
            future.result()
        except SGLangError as err:
            if "HTTP 400" not in str(err):
                raise type(err)(f"SGLang engine {name}: {err}") from err
            busy.append(name)
    return busy


class PendingFlushes:
    """Deferred `/flush_cache` calls, one per busy server, on threads of their own."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0
        self._calls: dict[str, Future] = {}

    def start(self, clients: Clients, timeout_s: float) -> None:
        self.check()
        new = {n: c for n, c in clients.items() if n not in self._calls}
        if not new:
            return
        need = len(self._calls) + len(new)
        if self._pool is None or self._size < need:  # the old pool's calls run on
            self._size = max(4, 2 * need)
            self._pool = ThreadPoolExecutor(self._size, thread_name_prefix="sglang-flush")
        path = f"/flush_cache?timeout={timeout_s:g}"
        for name, client in new.items():
            self._calls[name] = self._pool.submit(client.post, path, {}, timeout_s + 30.0)

    def check(self) -> None:
        """Forget the flushes that ended; warn about each that failed."""
        for name, future in list(self._calls.items()):
            if not future.done():
                continue
            del self._calls[name]
            error = future.exception()
            if error is not None and "already in progress" not in str(error):
                log.warning(
                    "SGLang engine %s: its radix cache was not flushed after an update in place "
                    "(%s); requests may have reused KV of older weights",
                    name,
                    error,
                )

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def restarted(pool: ThreadPoolExecutor, clients: Clients, sent: str) -> list[str]:
    """The servers whose weight_version is no longer `sent`, the version last sent to them."""
    futures = {name: pool.submit(client.get, "/model_info") for name, client in clients.items()}
    lost = []
    for name, future in futures.items():
        try:
            info = future.result()
        except SGLangError as err:
            raise type(err)(f"SGLang engine {name}: {err}") from err
        served = info.get("weight_version") if isinstance(info, dict) else None
        if str(served) != sent:
            lost.append(name)
    return lost
