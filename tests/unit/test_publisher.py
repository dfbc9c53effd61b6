"""The async trainer's weight publisher: a push that overlaps the next step holds the next
optimizer step until the engines have the weights, and a push that fails fails the trainer."""

from __future__ import annotations

import threading

import pytest

from relax_core.roles.publisher import WeightPublisher


class _Sender:
    """A weight-sync sender (the object-store sender's `push`), held until `go` is set."""

    def __init__(self, fail: bool = False) -> None:
        self.go = threading.Event()
        self.pushed: list[tuple[list, int]] = []
        self.fail = fail
        self.destroyed = False

    def push(self, named_tensors, version: int) -> None:
        self.go.wait(5)
        if self.fail:
            raise RuntimeError("engine gone")
        self.pushed.append((list(named_tensors), version))

    def needs_reform(self) -> bool:
        return True

    def destroy(self) -> None:
        self.destroyed = True


def test_an_overlapped_push_runs_beside_the_trainer_and_finish_waits_for_it():
    sender = _Sender()
    publisher = WeightPublisher(sender, lambda: [("w", 1)], overlap=True)
    publisher.publish(3, wait=False)
    assert publisher.in_flight and sender.pushed == []  # the trainer goes on meanwhile
    assert not publisher.needs_reform()  # never re-formed under a push in flight
    sender.go.set()
    publisher.finish()  # what the backend calls before its optimizer step
    assert sender.pushed == [([("w", 1)], 3)] and not publisher.in_flight
    assert publisher.needs_reform()


def test_without_overlap_a_push_completes_before_publish_returns():
    sender = _Sender()
    sender.go.set()
    publisher = WeightPublisher(sender, lambda: [("w", 1)], overlap=False)
    publisher.publish(1, wait=False)
    assert sender.pushed == [([("w", 1)], 1)] and not publisher.in_flight


def test_a_failed_overlapped_push_is_raised_in_the_trainer():
    sender = _Sender(fail=True)
    publisher = WeightPublisher(sender, lambda: [], overlap=True)
    publisher.publish(2, wait=False)
    sender.go.set()
    publisher._thread.join(5)
    with pytest.raises(RuntimeError, match="engine gone"):
        publisher.check()  # a trainer waiting for rows learns it at once
    publisher.close()  # nothing left in flight: the group is left
    assert sender.destroyed


def test_close_waits_for_the_push_in_flight_then_leaves_the_group():
    sender = _Sender()
    publisher = WeightPublisher(sender, lambda: [("w", 1)], overlap=True)
    publisher.publish(5, wait=False)
    threading.Timer(0.05, sender.go.set).start()
    publisher.close()
    assert sender.pushed == [([("w", 1)], 5)] and sender.destroyed
