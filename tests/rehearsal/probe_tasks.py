"""Flyte tasks that hand on a local path, as the workflow's tasks did before run state moved to
storage: the rehearsal must catch them (the output check), and without the check the next pod
must fail to find the path (the isolation)."""

from __future__ import annotations

import json
import os

from flytekit import task, workflow


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
