"""Flyte tasks the harness tests run in pods.

- leaky_pipeline hands on a local path, as the workflow's tasks did before run state moved to
  storage: the rehearsal must catch it (the output check), and without the check the next pod
  must fail to find the path (the isolation);
- stalled stalls past its timeout (seconds here, hours in tasks/): the driver must kill its
  attempt at T and retry it, and fail the node at 2T with most of its retries left, as
  propeller does;
- starts_big is a @dynamic whose node asks more memory than any rehearsal cluster allows
  (propeller would clamp it), greedy a task that asks as much (flyteadmin would refuse it).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

from flytekit import Resources, dynamic, task, workflow

TOO_MUCH = Resources(cpu="1", mem="1Ti")
"""Above docs/cluster.md's 768Gi per task."""
STALL_T_S = 3
"""stalls' timeout: its first attempt is killed at T and the retry at 2T, T after it started;
T is six times the driver's poll."""


@task
def leaky_checkpoint() -> str:
    """Write a checkpoint-like directory to this pod's own disk and hand on its path."""
    path = os.path.abspath(os.path.join(".relax", "checkpoints", "leak", "step_000001"))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "state.json"), "w") as f:
        json.dump({"policy_version": 1}, f)
    return path


@task
def read_checkpoint(checkpoint: str) -> int:
    with open(os.path.join(checkpoint, "state.json")) as f:
        return int(json.load(f)["policy_version"])


@workflow
def leaky_pipeline() -> int:
    return read_checkpoint(checkpoint=leaky_checkpoint())


@task(timeout=timedelta(seconds=STALL_T_S), retries=10)
def stalls() -> int:
    """Says which attempt it is (Flyte numbers them from 0), then stalls."""
    print(f"stalls: attempt {os.environ['FLYTE_ATTEMPT_NUMBER']}", flush=True)
    time.sleep(3600)
    return 0


@workflow
def stalled() -> int:
    return stalls()


@task
def echo(x: int) -> int:
    return x


@dynamic
def starts_big(x: int) -> int:
    return echo(x=x).with_overrides(requests=TOO_MUCH, limits=TOO_MUCH)


@workflow
def big_fanout() -> int:
    return starts_big(x=1)


@task(requests=TOO_MUCH, limits=TOO_MUCH)
def greedy() -> int:
    return 0
