"""Where a run's state goes: one storage root, the parts derived from it, and the early errors
a cluster run gets when something would land on a pod's own disk."""

from __future__ import annotations

import dataclasses
import json

import pytest

from relax_core.config import ConfigError, RunConfig, replace
from relax_core.run.lifecycle import cluster_problems, preflight


def test_every_part_of_the_state_lives_under_the_storage_root() -> None:
    cfg = replace(RunConfig(), storage={"root": "s3://b/runs", "endpoint_url": "http://s3:9000"})
    assert cfg.queue.root == "s3://b/runs/queue"
    assert cfg.queue.endpoint_url == "http://s3:9000"
    assert cfg.checkpoint.dir == "s3://b/runs/checkpoints"
    assert cfg.checkpoint.policy_cache_dir == "s3://b/runs/policies"
    # The local default keeps the layout users know.
    local = RunConfig()
    assert (local.queue.root, local.checkpoint.dir) == (".relax/queue", ".relax/checkpoints")
    # A part named on its own stays where it is named when the root moves.
    moved = replace(replace(RunConfig(), queue={"root": "/data/q"}), storage={"root": "s3://c/x"})
    assert moved.queue.root == "/data/q"
    assert moved.checkpoint.dir == "s3://c/x/checkpoints"
    # What a task hands the next (the config as JSON) names every place explicitly.
    assert RunConfig.from_json(json.dumps(dataclasses.asdict(cfg))) == cfg


def test_bad_storage_settings_are_named() -> None:
    with pytest.raises(ConfigError) as err:
        replace(RunConfig(), storage={"root": "/data", "endpoint_url": "s3.local"})
    assert "storage.endpoint_url: only used with an s3:// root" in str(err.value)
    assert "must start with http:// or https://" in str(err.value)
    with pytest.raises(ConfigError, match="storage.scratch_dir: a local directory"):
        replace(RunConfig(), storage={"scratch_dir": "s3://b/tmp"})


def test_a_cluster_run_with_state_or_tracking_on_a_pods_disk_fails_before_any_work(
    monkeypatch,
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    problems = cluster_problems(RunConfig())
    assert any(p.startswith("storage.root: '.relax' is a pod's own disk") for p in problems)
    assert not any(p.startswith("queue.root") for p in problems), "one line per cause"
    assert any(p.startswith("tracking.tracking_uri:") for p in problems)
    ok = replace(
        RunConfig(),
        storage={"root": "s3://b/r"},
        tracking={"tracking_uri": "http://mlflow:5000"},
    )
    assert cluster_problems(ok) == []
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    with pytest.raises(ConfigError, match="a pod's own disk on a cluster"):
        preflight(RunConfig())
