"""What each Flyte 2 task call asks of a cluster, in Flyte 2's terms: the asks of
relax_core/ops/asks.py (the same plain data tasks/resources.py gives flytekit) as the keyword
arguments of `task.override(...)`: resources (requests and limits), the accelerator, timeout,
retries, interruptible, and the pod template built from tasks/pods.py's Kubernetes objects.

Flyte 2 fixes a task's image with its TaskEnvironment (an override cannot change it), so the
image is the one thing not decided per call: `image_kind` says which image a task of a run needs,
and flyte2/train.py refuses a run whose model-holding tasks need another image than their
environment was registered with.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import flyte
from flyte import Device

from relax_core.config import RunConfig
from relax_core.ops import asks
from tasks.pods import SIDECAR, model_pod, sidecar_pod

IMAGE_ENV = {
    "default": "RELAX_IMAGE",
    "trainer": "RELAX_TRAINER_IMAGE",
    "rollout": "RELAX_ROLLOUT_IMAGE",
}
"""The environment variable naming each image's URI when the tasks are deployed (built from
Dockerfile, containers/trainer/Dockerfile, containers/rollout/Dockerfile with FLYTE2=1)."""


def image_uri(kind: str) -> str:
    """The URI of image `kind`; unset: Flyte 2's default ("auto"), which fits local runs only."""
    return os.environ.get(IMAGE_ENV[kind], "auto")


def resources(a: asks.Ask) -> flyte.Resources:
    """Requests and limits of CPU and memory, and the GPUs on the node label the config names
    (the label flytekit's GPUAccelerator carries, so both SDKs land on the same nodes)."""
    gpu = Device(quantity=a.gpus, device_class="GPU", device=a.accelerator) if a.gpus else None
    return flyte.Resources(
        cpu=(a.cpu, a.cpu_limit),
        memory=(f"{a.memory_gib}Gi", f"{a.memory_limit_gib}Gi"),
        gpu=gpu,
    )


def pod_template(a: asks.Ask) -> flyte.PodTemplate | None:
    """The pod of tasks/pods.py (shared memory, API key, preemption grace, SGLang sidecar), its
    containers' images the deployed URIs rather than flytekit's image templates."""
    if a.sidecar is not None:
        pod = sidecar_pod(a)
        for container in pod.pod_spec.containers:
            if container.name == SIDECAR:
                container.image = image_uri("rollout")
    elif a.shm or a.api_key_secret or a.grace_s:
        pod = model_pod(None, a.gpus, a.shm, a.api_key_secret, a.grace_s)
    else:
        return None
    return flyte.PodTemplate(
        pod_spec=pod.pod_spec, primary_container_name=pod.primary_container_name
    )


def call_overrides(
    cfg: RunConfig, task: str, remaining: int | None = None, timeout_s: float = 0
) -> dict[str, Any]:
    """`task.override(**...)` for one call of `task` in a run of `cfg` with `remaining` steps
    left (`timeout_s` replaces the timeout). Refused when the task would start an engine its
    image lacks."""
    a = asks.task_ask(cfg, task, remaining)
    problem = asks.image_problem(cfg, task, a.image)
    if problem:
        raise ValueError(problem)
    out: dict[str, Any] = {
        "resources": resources(a),
        "retries": a.retries,
        "interruptible": a.interruptible,
        "timeout": timedelta(seconds=timeout_s or a.timeout_s),
    }
    pod = pod_template(a)
    if pod is not None:
        out["pod_template"] = pod
    return out


def image_kind(cfg: RunConfig, task: str) -> str:
    """The image ('default', 'trainer') `task` runs in for a run of `cfg`."""
    return asks.task_ask(cfg, task).image
