"""How a rollout process's engine gets the trainer's weights: the one interface the rollout loop uses.

- `LocalWeights`: a torch engine in this process. A receiver (broadcast group or object store)
  joins in a background thread (the trainer may still be starting) and stages updates; they are
  applied between generate calls, or between decode steps with partial rollouts.
- `ServedWeights`: an SGLang server this process drives over HTTP. The trainer sends the server
  its weights itself (SGLang's weight group); here the served version is only read back, from
  every answer and, before admitting work, from `/model_info` (admission under the
  staleness bound needs the version the server holds now).

Both: `apply_pending()` (True when the engine's version moved), `wait(timeout)` (until news may
have arrived), `holds_trainer_weights()` (a new engine may take work) and `close(drained)`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from relax_core.sync import apply_update


class LocalWeights:
    def __init__(self, engine, receiver, status: dict[str, Any]) -> None:
        self.engine, self.receiver, self.status = engine, receiver, status
        self._joined: list[BaseException | None] = []
        self._joiner = threading.Thread(target=self._join, name="weight-sync-join", daemon=True)
        self._got_update = False

    def start(self) -> None:
        self._joiner.start()

    def _join(self) -> None:
        try:
            self.receiver.init()
            self.receiver.start()
            self._joined.append(None)
        except BaseException as exc:  # re-raised by the generation loop
            self._joined.append(exc)

    def apply_pending(self) -> bool:
        if not self._joined:
            return False
        if self._joined[0] is not None:
            raise RuntimeError("rollout could not join weight sync") from self._joined[0]
        update = self.receiver.take()
        if update is None:
            return False
        apply_update(self.engine, update, self.receiver.release)
        self.status["policy_version"] = self.engine.version
        self._got_update = True
        return True

    def holds_trainer_weights(self) -> bool:
        return self.apply_pending() or self._got_update

    def wait(self, timeout: float) -> None:
        if self._joined:
            self.receiver.wait(timeout=timeout)
        else:
            self._joiner.join(timeout=timeout)

    def close(self, drained: bool, timeout_s: float) -> None:
        if not (self._joined and self._joined[0] is None):
            return  # never joined: nothing to leave (a daemon thread)
        if not drained:
            self.receiver.destroy()
            return
        # The trainer leaves a draining engine out of its next generation; exiting while still
        # in the old one would tear gloo down under its receive (the process aborts).
        deadline = time.monotonic() + timeout_s
        while getattr(self.receiver, "in_group", False) and time.monotonic() < deadline:
            time.sleep(0.05)


class ServedWeights:
    """The weights an SGLang server serves, as its rollout process sees them."""

    def __init__(self, engine, synced, status: dict[str, Any], poll_s: float = 0.02) -> None:
        self.engine, self.synced, self.status, self.poll_s = engine, synced, status, poll_s
        self._seen = engine.version
        self._next_poll = 0.0

    def start(self) -> None:
        self.engine.refresh_version()

    def apply_pending(self) -> bool:
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + self.poll_s
            self.engine.refresh_version()
        moved = self.engine.version != self._seen
        self._seen = self.engine.version
        if moved:
            self.status["policy_version"] = self.engine.version
        return moved

    def holds_trainer_weights(self) -> bool:
        """The trainer names this engine in its SGLang group only after the server holds the
        update that formed it."""
        return bool(self.synced()) and self.engine.refresh_version() >= 0

    def wait(self, timeout: float) -> None:
        time.sleep(timeout)  # news comes by polling the server (apply_pending)

    def close(self, drained: bool, timeout_s: float) -> None:
        pass  # the server is not ours to stop; the trainer leaves it out of its group
