"""The MLflow model registry: the final policy of a run as a registered model version, and a
registered version back as a local policy directory.

- `register_policy` logs a checkpoint (weights, tokenizer, state.json; not the optimizer) as a
  pyfunc model of the training run (`policy_pyfunc.py`, loaded from code) and registers it under
  `tracking.registered_model`. A retried finish finds the version this run and policy version
  already registered instead of adding a second one.
- `resolve_model_uri` pins `models:/<name>/latest` or `models:/<name>@<alias>` to one version, so a
  cached starting policy or an evaluation always names exactly the weights it used.
- `download_policy` fetches a version's `policy` artifact into a cache directory, whole or not at
  all, and returns the Hugging Face directory inside it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass

from mlflow.tracking import MlflowClient

from relax_core.config.checks import MODEL_URI

# A progress bar per artifact download would cut through the run's own progress bar.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

POLICY_ARTIFACT = "policy"
_SKIP_FILES = {"optimizer.pt", "optim", "megatron", "master.safetensors"}
"""Optimizer state and master weights (train/factory.py TRAINER_ONLY) stay out of a registered
policy."""
_HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class RegisteredPolicy:
    name: str
    version: int

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def register_policy(
    tracking_uri: str,
    run_id: str,
    checkpoint: str,
    name: str,
    *,
    model_config: dict[str, object],
    tags: dict[str, str],
    description: str = "",
) -> RegisteredPolicy:
    """Log `checkpoint` as the run's pyfunc model and register it as a new version of `name`."""
    policy_version = str(tags.get("relax.policy_version", ""))
    found = _version_of_run(tracking_uri, name, run_id, policy_version)
    if found is not None:
        return found
    import mlflow

    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(tracking_uri)
    staging = tempfile.mkdtemp(prefix="relax-policy-")
    try:
        policy_dir = os.path.join(staging, POLICY_ARTIFACT)
        shutil.copytree(
            checkpoint, policy_dir, ignore=lambda _d, names: [n for n in names if n in _SKIP_FILES]
        )
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=POLICY_ARTIFACT,
                python_model=os.path.join(_HERE, "policy_pyfunc.py"),
                artifacts={POLICY_ARTIFACT: policy_dir},
                model_config=model_config,
                signature=_signature(int(model_config.get("max_new_tokens", 64))),
                pip_requirements=_requirements(),
                tags=tags,
            )
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        mlflow.set_tracking_uri(previous)
    # Registered through a client bound to this store: the fluent registry follows a
    # process-wide URI that another part of the program may have set.
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    if not _model_exists(client, name):
        client.create_registered_model(name)
    # The logged model's storage location, not its models:/m-... URI: MLflow's SQL registry
    # looks such a URI up through a client on the process-wide tracking URI (a TODO in
    # mlflow/store/model_registry/sqlalchemy_store.py, create_model_version).
    location = client.get_logged_model(info.model_id).artifact_location
    version = client.create_model_version(
        name,
        source=location,
        run_id=run_id,
        tags=tags,
        description=description or None,
        model_id=info.model_id,
    ).version
    return RegisteredPolicy(name, int(version))


def _signature(max_new_tokens: int):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, ParamSchema, ParamSpec, Schema

    return ModelSignature(
        inputs=Schema([ColSpec("string")]),
        outputs=Schema([ColSpec("string")]),
        params=ParamSchema([ParamSpec("max_new_tokens", "long", max_new_tokens)]),
    )


def _requirements() -> list[str]:
    """What serving the model needs, pinned to what trained it (inferring it would load the
    model in a subprocess, ~10 s). A package that runs without being installed (relax-flyte
    from a checkout on PYTHONPATH, mlflow-skinny in place of mlflow) is left out: no pin of it
    can be had, and a made-up one would fail the install."""
    from importlib.metadata import PackageNotFoundError, version

    pins = []
    for package in ("relax-flyte", "torch", "transformers", "mlflow"):
        try:
            pins.append(f"{package}=={version(package)}")
        except PackageNotFoundError:
            continue
    return pins


def _version_of_run(
    tracking_uri: str, name: str, run_id: str, policy_version: str
) -> RegisteredPolicy | None:
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    if not _model_exists(client, name):
        return None
    for mv in client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'"):
        if mv.tags.get("relax.policy_version", "") == policy_version:
            return RegisteredPolicy(name, int(mv.version))
    return None


def _model_exists(client: MlflowClient, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        return False
    return True


def resolve_model_uri(tracking_uri: str, uri: str) -> RegisteredPolicy:
    """The one version `uri` names now; raises ValueError naming the model if there is none."""
    from mlflow.exceptions import MlflowException

    match = MODEL_URI.fullmatch(uri)
    if match is None:
        raise ValueError(
            f"{uri!r} is not a registry reference; use models:/<name>/<version>, "
            "models:/<name>/latest or models:/<name>@<alias>"
        )
    name, version, alias = match["name"], match["version"], match["alias"]
    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    if not _model_exists(client, name):
        raise ValueError(f"{uri}: no registered model {name!r} in {tracking_uri}")
    try:
        if alias:
            return RegisteredPolicy(
                name, int(client.get_model_version_by_alias(name, alias).version)
            )
        if version == "latest":
            versions = client.search_model_versions(f"name = '{name}'")
            if not versions:
                raise ValueError(f"{uri}: registered model {name!r} has no versions yet")
            return RegisteredPolicy(name, max(int(v.version) for v in versions))
        return RegisteredPolicy(name, int(client.get_model_version(name, version).version))
    except MlflowException as exc:
        raise ValueError(f"{uri}: {exc.message}") from exc


def download_policy(tracking_uri: str, uri: str, cache_dir: str) -> str:
    """Local Hugging Face directory of the policy `uri` names (downloaded once per version)."""
    from mlflow.artifacts import download_artifacts

    pinned = resolve_model_uri(tracking_uri, uri)
    target = os.path.abspath(os.path.join(cache_dir, f"{pinned.name}-v{pinned.version}"))
    policy_dir = os.path.join(target, POLICY_ARTIFACT)
    if os.path.isfile(os.path.join(policy_dir, "config.json")):
        return policy_dir
    os.makedirs(cache_dir, exist_ok=True)
    staging = f"{target}.tmp-{uuid.uuid4().hex}"
    try:
        # The version's own artifact location, not its models:/ URI: MLflow resolves those
        # against the process-wide registry URI, whatever tracking URI is passed.
        client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
        source = client.get_model_version_download_uri(pinned.name, str(pinned.version))
        os.makedirs(staging)
        try:
            download_artifacts(
                artifact_uri=f"{source.rstrip('/')}/artifacts/{POLICY_ARTIFACT}",
                dst_path=staging,
                tracking_uri=tracking_uri,
            )
        except Exception as exc:  # noqa: BLE001 - named below, whatever the store raised
            raise ValueError(
                f"{pinned.uri} holds no '{POLICY_ARTIFACT}' artifact ({exc}); it was not "
                "registered by a Relax run"
            ) from exc
        if not os.path.isfile(os.path.join(staging, POLICY_ARTIFACT, "config.json")):
            raise ValueError(
                f"{pinned.uri}: its '{POLICY_ARTIFACT}' artifact has no config.json; it was not "
                "registered by a Relax run"
            )
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return policy_dir
