"""What the pod rehearsal's test files share: the module-scoped cluster, the run configs they
start from and the MLflow reads that check a run (tests/integration/test_pod_rehearsal*.py).

Each test file gets a cluster of its own (a module-scoped fixture), so pytest-xdist can run the
colocate and the async rehearsal side by side on two workers.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from relax_core.config import config_from_dict, config_to_dict
from tests.rehearsal.cluster import REPO, open_cluster

ROOT_PREFIX = "runs"
"""The storage root's prefix under the cluster's bucket (each run has its own run id under it)."""


@pytest.fixture(scope="module", name="cluster")
def rehearsal_cluster(tmp_path_factory):
    """Network, storage host and pod launcher, shared by the module; where namespaces cannot be
    made, open_network says so (an IsolationUnavailable warning and a printed line)."""
    with open_cluster(tmp_path_factory.mktemp("rehearsal")) as c:
        yield c


def rehearsal_config(cluster, name: str, **sections) -> dict:
    """configs/<name> with `sections` merged in, its state under the shared storage root."""
    data = yaml.safe_load(Path(REPO, "configs", name).read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["storage"] = {
        "root": cluster.storage_root(ROOT_PREFIX),
        "endpoint_url": cluster.endpoint_url,
    }
    data.setdefault("tracking", {})["progress"] = False
    return config_to_dict(config_from_dict(data))


def logged_steps(tracking_uri: str, run_id: str, key: str) -> tuple[str, set[int]]:
    """(the MLflow run's status, the steps at which `key` was logged)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    status = client.get_run(run_id).info.status
    return status, {m.step for m in client.get_metric_history(run_id, key)}


def registered_from(tracking_uri: str, model: str) -> list[str]:
    """The MLflow run ids the versions of registered model `model` came from."""
    from mlflow.tracking import MlflowClient

    return [v.run_id for v in MlflowClient(tracking_uri).search_model_versions(f"name='{model}'")]


def versions(records) -> list[int]:
    """The policy versions the pods' checkpoints (output o0) name, in pod order."""
    return [int(r.outputs["o0"].rsplit("_", 1)[-1]) for r in records if r.outputs]
