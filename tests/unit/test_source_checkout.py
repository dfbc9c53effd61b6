"""A run started from a checkout on PYTHONPATH, without `pip install` (an image that copies the
repo, the GPU bring-up kit), has no relax-flyte package metadata: its MLflow tags and the
registered policy's requirements must still be written, not fail the run at its end."""

from __future__ import annotations

import importlib.metadata

import pytest

from relax_core.tracking import registry, runs

_real_version = importlib.metadata.version


def _not_installed(*missing: str):
    def version(name: str) -> str:
        if name in missing:
            raise importlib.metadata.PackageNotFoundError(name)
        return _real_version(name)

    return version


def test_run_tags_name_a_source_checkout(monkeypatch):
    assert runs.run_tags("r", "colocate")["relax.version"] == _real_version("relax-flyte")
    monkeypatch.setattr(runs, "version", _not_installed("relax-flyte"))
    tags = runs.run_tags("r", "async")
    assert tags["relax.version"] == "source"
    assert tags["relax.run_id"] == "r" and tags["relax.mode"] == "async"


def test_policy_requirements_leave_out_what_is_not_installed(monkeypatch):
    pinned = registry._requirements()
    assert [p.split("==")[0] for p in pinned] == ["relax-flyte", "torch", "transformers", "mlflow"]
    # mlflow-skinny in place of mlflow, relax-flyte from a checkout: no made-up pin of either.
    monkeypatch.setattr(importlib.metadata, "version", _not_installed("relax-flyte", "mlflow"))
    assert registry._requirements() == [
        f"torch=={_real_version('torch')}",
        f"transformers=={_real_version('transformers')}",
    ]


@pytest.mark.parametrize("name", ["relax-flyte", "mlflow"])
def test_a_pin_is_the_installed_version(name):
    assert f"{name}=={_real_version(name)}" in registry._requirements()
