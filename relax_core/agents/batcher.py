"""Concurrent endpoint calls -> batched `engine.generate` calls, from one thread that owns the engine.

Agents run in their own threads and each waits on its call; an engine serves a batch far faster
than the same prompts one by one. The batcher takes the first waiting call, then gathers more until
every running episode has one waiting (`waiting_for()`), or `window_s` has passed since the first
(an agent busy with its tool does not hold the others up for longer). Calls share one generate
call with the largest of their token caps; each is cut back to its own cap, which is exactly a
sample drawn with that cap.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from relax_core.rollout.engine import Completion, SamplingParams


class BatcherClosed(RuntimeError):
    """The rollout the call belonged to has ended."""


@dataclasses.dataclass
class _Pending:
    prompt_ids: list[int]
    cap: int
    future: Future


class EngineBatcher:
    """`submit` from any thread; one worker thread calls `engine.generate`."""

    def __init__(
        self,
        engine,
        params: SamplingParams,
        waiting_for: Callable[[], int],
        window_s: float = 0.02,
    ) -> None:
        self.engine, self.params, self.waiting_for = engine, params, waiting_for
        self.window_s = window_s
        self.calls = 0
        # A new thread starts with the process's default intra-op threads, not the role's budget.
        self._torch_threads = torch.get_num_threads()
        """generate calls made (each serves one batch)."""
        self._inbox: queue.Queue[_Pending | None] = queue.Queue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agent-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], cap: int) -> Completion:
        """Generate up to `cap` tokens after `prompt_ids` with the run's sampling settings;
        blocks until done. Raises the engine's error, or BatcherClosed."""
        if self._closed.is_set():
            raise BatcherClosed("the rollout this episode belonged to has ended")
        future: Future = Future()
        self._inbox.put(_Pending(list(prompt_ids), cap, future))
        return future.result()

    def close(self) -> None:
        self._closed.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)
        while True:  # calls that arrived after the worker stopped
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item.future.set_exception(BatcherClosed("the rollout has ended"))

    def _run(self) -> None:
        torch.set_num_threads(self._torch_threads)
        while not self._closed.is_set():
            first = self._inbox.get()
            if first is None:
                break
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while len(batch) < max(1, self.waiting_for()):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    item = self._inbox.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self._closed.set()
                    break
                batch.append(item)
            self._serve(batch)
        # close() fails the calls still waiting, once this thread has stopped taking them.

    def _serve(self, batch: list[_Pending]) -> None:
        params = dataclasses.replace(self.params, max_new_tokens=max(p.cap for p in batch))
        try:
            completions = self.engine.generate([p.prompt_ids for p in batch], params)
            if len(completions) != len(batch):
                raise RuntimeError(
                    f"the engine returned {len(completions)} completions for {len(batch)} prompts"
                )
        except BaseException as err:  # noqa: BLE001 - every waiting call gets the error
            for p in batch:
                p.future.set_exception(err)
            return
        self.calls += 1
        for p, comp in zip(batch, completions, strict=True):
            if len(comp.response_ids) > p.cap:
                comp = dataclasses.replace(
                    comp,
                    response_ids=comp.response_ids[: p.cap],
                    logprobs=comp.logprobs[: p.cap],
                    finish_reason="length",
                )
            p.future.set_result(comp)
