"""What the role tasks run in on a cluster: one image per role and the SGLang rollout pod.

Images are named, resolved when the workflows are registered:

    pyflyte register --image ghcr.io/org/relax:v1 \\
        --image trainer=ghcr.io/org/relax-trainer:v1 --image rollout=ghcr.io/org/relax-rollout:v1

- default (`Dockerfile`): the engine with CPU torch; light tasks and the SGLang rollout driver.
- trainer (`containers/trainer/Dockerfile`): CUDA torch + megatron-core; every task that holds
  the model on a GPU.
- rollout (`containers/rollout/Dockerfile`): the SGLang server, run as the sidecar of the
  rollout pod.

The SGLang rollout pod: the primary container (the rollout service, CPU only: it drives the
engine over HTTP) writes the starting policy into a shared `emptyDir` and the sidecar
(`containers/rollout/serve.sh`) starts `sglang.launch_server` on it once it is complete, on the
pod's GPU, listening on loopback only. /dev/shm is a memory volume, as SGLang's tensor-parallel
workers need more than the container default.
"""

from __future__ import annotations

from flytekit import PodTemplate
from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1EmptyDirVolumeSource,
    V1EnvVar,
    V1HTTPGetAction,
    V1PodSpec,
    V1Probe,
    V1ResourceRequirements,
    V1Toleration,
    V1Volume,
    V1VolumeMount,
)

TRAINER_IMAGE = "{{.image.trainer.fqn}}:{{.image.trainer.version}}"
ROLLOUT_IMAGE = "{{.image.rollout.fqn}}:{{.image.rollout.version}}"

SGLANG_PORT = 30000
SGLANG_URL = f"http://127.0.0.1:{SGLANG_PORT}"
MODEL_DIR = "/models"
"""Shared by the two containers: the primary writes `policy/` and then `policy/READY`."""
PRIMARY = "primary"
SIDECAR = "sglang"


def sglang_rollout_pod(gpus: int = 1, tensor_parallel: int = 1) -> PodTemplate:
    """The rollout pod: the rollout service plus an SGLang server sidecar on `gpus` GPUs."""
    shared = V1VolumeMount(name="models", mount_path=MODEL_DIR)
    sidecar = V1Container(
        name=SIDECAR,
        image=ROLLOUT_IMAGE,
        command=["/opt/relax/serve.sh"],
        env=[
            V1EnvVar(name="RELAX_MODEL_DIR", value=f"{MODEL_DIR}/policy"),
            V1EnvVar(name="SGLANG_PORT", value=str(SGLANG_PORT)),
            V1EnvVar(name="SGLANG_TP", value=str(tensor_parallel)),
        ],
        ports=[V1ContainerPort(container_port=SGLANG_PORT, name="sglang")],
        resources=V1ResourceRequirements(
            requests={"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": str(gpus)},
            limits={"cpu": "16", "memory": "96Gi", "nvidia.com/gpu": str(gpus)},
        ),
        readiness_probe=V1Probe(
            http_get=V1HTTPGetAction(path="/health", port=SGLANG_PORT),
            period_seconds=10,
            failure_threshold=3,
        ),
        volume_mounts=[shared, V1VolumeMount(name="dshm", mount_path="/dev/shm")],
    )
    primary = V1Container(
        name=PRIMARY,
        env=[
            V1EnvVar(name="RELAX_SGLANG_URL", value=SGLANG_URL),
            V1EnvVar(name="RELAX_MODEL_DIR", value=f"{MODEL_DIR}/policy"),
        ],
        volume_mounts=[shared],
    )
    return PodTemplate(
        primary_container_name=PRIMARY,
        pod_spec=V1PodSpec(
            containers=[primary, sidecar],
            volumes=[
                V1Volume(name="models", empty_dir=V1EmptyDirVolumeSource()),
                V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory")),
            ],
            tolerations=[
                V1Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")
            ],
        ),
    )
