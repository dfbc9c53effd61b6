"""The trainer's push to its servers (pool/weights.py TrainerSync) when one dies under it: sent
again to those that answer, instead of failing the trainer (and restarting it) for a server its
rollout worker restarts anyway; any other failure still fails the push."""

from __future__ import annotations

import pytest
import torch

from relax_core.pool.weights import TrainerSync


class Servers:
    """A server sender whose first push dies mid-update; `left_out` says whether a server
    stopped answering (what a sender that leaves out dead servers then reports)."""

    def __init__(self, left_out: bool) -> None:
        self.left_out = left_out
        self.pushes: list[tuple[int, int]] = []
        self.members = [("rollout-0", "http://a"), ("rollout-1", "http://b")]
        self.generation = 0
        self.rendezvous = {"group_name": "g"}

    def push(self, named, version: int) -> bool:
        self.pushes.append((version, sum(1 for _ in named)))
        if len(self.pushes) == 1:
            raise RuntimeError("connection reset by peer (a server died mid-broadcast)")
        self.members = self.members[:1]
        self.generation += 1
        return True

    def needs_reform(self) -> bool:
        return self.left_out

    def destroy(self) -> None:
        pass


class Store:
    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def write_replace(self, key: str, data: bytes) -> None:
        self.keys[key] = data


class Queue:
    def __init__(self) -> None:
        self.store = Store()


def weights():
    return [("w", torch.zeros(2)), ("b", torch.ones(1))]


def test_a_server_that_died_under_the_push_gets_the_version_sent_to_the_rest():
    servers = Servers(left_out=True)
    queue = Queue()
    sync = TrainerSync(None, servers, queue)
    assert sync.push_or_reform(weights, 3) is True
    assert servers.pushes == [(3, 2), (3, 2)]  # every weight, twice: the stream read again
    assert "control/sglang_sync" in queue.store.keys  # the members that hold version 3


def test_a_failure_with_every_server_answering_still_fails_the_push():
    servers = Servers(left_out=False)
    sync = TrainerSync(None, servers, Queue())
    with pytest.raises(RuntimeError, match="died mid-broadcast"):
        sync.push_or_reform(weights, 3)
    assert len(servers.pushes) == 1
