"""What the role tasks run in on a cluster: one image per role, and the pods a container alone
cannot describe. What each task gets is decided from the run config in tasks/resources.py; this
module only builds the Kubernetes objects.

Images are named, resolved when the workflows are registered:

    pyflyte register --image ghcr.io/org/relax:v1 \\
        --image trainer=ghcr.io/org/relax-trainer:v1 --image rollout=ghcr.io/org/relax-rollout:v1

- default (`Dockerfile`): the engine with CPU torch; light tasks, a CPU-only run's tasks, and the
  SGLang rollout driver.
- trainer (`containers/trainer/Dockerfile`): CUDA torch + megatron-core; every task that holds
  the model on a GPU. SGLang and vLLM in venvs of their own ($RELAX_SGLANG_PYTHON,
  $RELAX_VLLM_PYTHON), for the tasks that start their engine's server beside the trainer.
- rollout (`containers/rollout/Dockerfile`): the SGLang server, run as the sidecar of the
  rollout pod.

`model_pod`: the task's container plus a memory-backed /dev/shm (NCCL between the GPUs of one pod
and SGLang's tensor-parallel workers outgrow the container runtime's 64 MiB default) and, for a
pod that drives SGLang servers in other pods, their API key.

`sglang_rollout_pod`: the primary container (the rollout service, CPU only: it drives the engine
over HTTP) writes the starting policy into a shared `emptyDir`; the sidecar
(`containers/rollout/serve.sh`) starts `sglang.launch_server` on it once it is complete, on the
sidecar's GPUs, listening on the pod's address, since the trainer in another pod drives its
weight updates. The primary publishes `http://<pod IP>:30000` (Kubernetes expands
`$(RELAX_POD_IP)`, the downward API's status.podIP, in RELAX_SGLANG_URL). Both containers read
the API key from the run's secret: the server requires it on everything but /health*, and the
rollout client sends it (relax_core/rollout/sglang_engine.py). The sidecar ends with the primary
(a pod ends only when all its containers have, and Flyte keeps finished pods by default): the
primary writes DONE when it exits and touches HEARTBEAT while it lives, beside the policy, and
serve.sh stops the server on either.
"""

from __future__ import annotations

from flytekit import PodTemplate
from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1EmptyDirVolumeSource,
    V1EnvVar,
    V1EnvVarSource,
    V1HTTPGetAction,
    V1ObjectFieldSelector,
    V1PodSpec,
    V1Probe,
    V1ResourceRequirements,
    V1SecretKeySelector,
    V1Toleration,
    V1Volume,
    V1VolumeMount,
)

from relax_core.ops.asks import Ask
from relax_core.rollout.sglang_engine import API_KEY_ENV

TRAINER_IMAGE = "{{.image.trainer.fqn}}:{{.image.trainer.version}}"
ROLLOUT_IMAGE = "{{.image.rollout.fqn}}:{{.image.rollout.version}}"
DOCKERFILES = {
    None: "Dockerfile",
    TRAINER_IMAGE: "containers/trainer/Dockerfile",
    ROLLOUT_IMAGE: "containers/rollout/Dockerfile",
}
"""What each image is built from (None: the default image)."""
IMAGE_ENGINES: dict[str | None, tuple[str, ...]] = {
    None: (),
    TRAINER_IMAGE: ("sglang", "vllm"),
    ROLLOUT_IMAGE: ("sglang",),
}
"""The engine servers each image can start (tests/unit/test_containers.py reads the Dockerfiles
to check it)."""

SGLANG_PORT = 30000
SGLANG_URL = f"http://$(RELAX_POD_IP):{SGLANG_PORT}"
"""What the rollout service publishes for the trainer; the pod IP var must come first in env."""
SECRET_KEY = "api-key"
"""The key, in the run's secret (sglang.api_key_secret), that holds the SGLang API key."""
MODEL_DIR = "/models"
"""Shared by the two containers: the primary writes `policy/` and then `policy/READY`, and beside
it `HEARTBEAT` while it lives and `DONE` when it exits (relax_core/rollout/sidecar.py)."""
SIDECAR_GRACE_S = 30
"""Seconds serve.sh gives the SGLang server between SIGTERM and SIGKILL when it stops it."""
POD_GRACE_S = SIDECAR_GRACE_S + 15
"""The rollout pod's terminationGracePeriodSeconds: the kubelet's SIGKILL comes after serve.sh
has had its grace (and a poll interval) to stop the server, not in the middle of it."""
PRIMARY = "primary"
SIDECAR = "sglang"
GPU = "nvidia.com/gpu"

_SHM = V1Volume(name="dshm", empty_dir=V1EmptyDirVolumeSource(medium="Memory"))
_SHM_MOUNT = V1VolumeMount(name="dshm", mount_path="/dev/shm")
_ON_GPU_NODES = [V1Toleration(key=GPU, operator="Exists", effect="NoSchedule")]


def api_key_env(secret: str) -> V1EnvVar:
    """$RELAX_SGLANG_API_KEY from the run's secret; no `optional`: a pod whose secret is missing
    does not start, rather than run a server anyone in the cluster may update."""
    ref = V1SecretKeySelector(name=secret, key=SECRET_KEY)
    return V1EnvVar(name=API_KEY_ENV, value_from=V1EnvVarSource(secret_key_ref=ref))


def model_pod(
    image: str | None, gpus: int, shm: bool, api_key_secret: str = "", grace_s: float = 0
) -> PodTemplate:
    """The task's own container (`image`; None = the task's) with a memory /dev/shm when `shm`,
    the SGLang API key when `api_key_secret` names the run's secret, and `grace_s` seconds
    between SIGTERM and SIGKILL when it trains (the checkpoint a preempted pod writes)."""
    primary = V1Container(
        name=PRIMARY,
        image=image,
        env=[api_key_env(api_key_secret)] if api_key_secret else None,
        volume_mounts=[_SHM_MOUNT] if shm else None,
    )
    spec = V1PodSpec(
        containers=[primary],
        volumes=[_SHM] if shm else None,
        tolerations=_ON_GPU_NODES if gpus else None,
        termination_grace_period_seconds=int(grace_s) if grace_s else None,
    )
    return PodTemplate(primary_container_name=PRIMARY, pod_spec=spec)


def sidecar_pod(a: Ask) -> PodTemplate:
    """The rollout pod for a task's ask (relax_core/ops/asks.py) that carries an SGLang sidecar:
    sglang_rollout_pod with the sidecar's flags, GPUs, requests, limits and API key secret."""
    s = a.sidecar
    if s is None:
        raise ValueError("sidecar_pod: the task's ask has no SGLang sidecar")
    return sglang_rollout_pod(
        list(s.args),
        s.gpus,
        {"cpu": str(s.cpu), "memory": f"{s.memory_gib}Gi"},
        {"cpu": str(s.cpu_limit), "memory": f"{s.memory_limit_gib}Gi"},
        a.api_key_secret,
    )


def sglang_rollout_pod(
    server_args: list[str],
    gpus: int,
    requests: dict[str, str],
    limits: dict[str, str],
    api_key_secret: str,
) -> PodTemplate:
    """The rollout pod: the rollout service plus an SGLang server sidecar on `gpus` GPUs, started
    with `server_args` (tensor parallel and the other flags the run's config decides)."""
    shared = V1VolumeMount(name="models", mount_path=MODEL_DIR)
    model_env = V1EnvVar(name="RELAX_MODEL_DIR", value=f"{MODEL_DIR}/policy")
    if gpus:
        requests, limits = {**requests, GPU: str(gpus)}, {**limits, GPU: str(gpus)}
    sidecar = V1Container(
        name=SIDECAR,
        image=ROLLOUT_IMAGE,
        command=["/opt/relax/serve.sh"],
        args=list(server_args),
        env=[
            model_env,
            V1EnvVar(name="SGLANG_HOST", value="0.0.0.0"),
            V1EnvVar(name="SGLANG_PORT", value=str(SGLANG_PORT)),
            V1EnvVar(name="RELAX_SIDECAR_GRACE_S", value=str(SIDECAR_GRACE_S)),
            api_key_env(api_key_secret),
        ],
        ports=[V1ContainerPort(container_port=SGLANG_PORT, name="sglang")],
        resources=V1ResourceRequirements(requests=requests, limits=limits),
        # SGLang's /health generates a token (a second at least, past the kubelet's default
        # 1 s timeout); /ready answers at once (warmed up, not paused). Both need no API key.
        readiness_probe=V1Probe(
            http_get=V1HTTPGetAction(path="/ready", port=SGLANG_PORT),
            period_seconds=10,
            timeout_seconds=5,
            failure_threshold=3,
        ),
        volume_mounts=[shared, _SHM_MOUNT],
    )
    pod_ip = V1EnvVarSource(field_ref=V1ObjectFieldSelector(field_path="status.podIP"))
    primary = V1Container(
        name=PRIMARY,
        env=[
            V1EnvVar(name="RELAX_POD_IP", value_from=pod_ip),
            V1EnvVar(name="RELAX_SGLANG_URL", value=SGLANG_URL),
            model_env,
            api_key_env(api_key_secret),
        ],
        volume_mounts=[shared],
    )
    return PodTemplate(
        primary_container_name=PRIMARY,
        pod_spec=V1PodSpec(
            containers=[primary, sidecar],
            volumes=[V1Volume(name="models", empty_dir=V1EmptyDirVolumeSource()), _SHM],
            tolerations=_ON_GPU_NODES if gpus else None,
            termination_grace_period_seconds=POD_GRACE_S,
        ),
    )
