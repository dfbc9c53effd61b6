"""What each Flyte task asks of a cluster, in flytekit's terms. The asks themselves (GPUs, CPUs,
memory, image, pod needs, timeout, retries) are plain data decided from a run config in
relax_core/ops/asks.py, which `relax plan --flyte` checks against a cluster's limits; this module
turns them into `@task` arguments and node overrides.

Tasks are decorated when tasks/rl.py is imported, before any run's config exists, so they carry
the asks of the registration config: the YAML file $RELAX_CONFIG names, else the default config
(CPU only). The @dynamic nodes of workflows/train.py give every node they start (rl_steps,
async_local, the role tasks) the asks of the run's own config (`node_overrides`), timeouts
included; the static nodes keep the registration config's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from flytekit import FlyteContextManager, PodTemplate, Resources
from flytekit.core.base_task import PythonTask
from flytekit.core.python_auto_container import get_registerable_container_image
from flytekit.extras.accelerators import GPUAccelerator

from relax_core.config import RunConfig, load_config
from relax_core.ops import asks
from relax_core.ops.asks import LIGHT, TASKS, engine_served, gpus  # noqa: F401 - re-exported
from tasks.pods import ROLLOUT_IMAGE, TRAINER_IMAGE, model_pod, sidecar_pod

CONFIG_ENV = "RELAX_CONFIG"
IMAGE_OF = {"default": None, "trainer": TRAINER_IMAGE, "rollout": ROLLOUT_IMAGE}
"""asks' image names -> flytekit image templates (None: the default image)."""


@dataclass(frozen=True)
class Ask:
    """What one task asks of a cluster, as flytekit takes it."""

    requests: Resources
    limits: Resources
    accelerator: GPUAccelerator | None = None
    image: str | None = None
    """An image template ({{.image.trainer...}}); None = the default image."""
    pod_template: PodTemplate | None = None
    timeout: timedelta | None = None
    retries: int = 0
    interruptible: bool = False

    def task_args(self) -> dict[str, Any]:
        """Keyword arguments of `@task` (and `@dynamic`)."""
        args: dict[str, Any] = {"requests": self.requests, "limits": self.limits}
        if self.accelerator is not None:
            args["accelerator"] = self.accelerator
        if self.image is not None:
            args["container_image"] = self.image
        if self.pod_template is not None:
            args["pod_template"] = self.pod_template
        if self.timeout is not None:
            args["timeout"] = self.timeout
        args["retries"] = self.retries
        if self.interruptible:
            args["interruptible"] = True
        return args


@functools.cache
def registration_config() -> RunConfig:
    """The config the task decorators take their asks from: $RELAX_CONFIG, else the default."""
    path = os.environ.get(CONFIG_ENV, "")
    if not path:
        return RunConfig()
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{CONFIG_ENV}={path}: no such file; it names the run config whose resources the "
            "tasks are registered with (unset: the default, CPU only)"
        )
    return load_config(path)


def registered(task: str) -> dict[str, Any]:
    """`@task` keyword arguments of `task` under the registration config."""
    return flyte_ask(asks.registered_ask(registration_config(), task)).task_args()


def _resources(cpu: int, memory_gib: int, n_gpus: int) -> Resources:
    return Resources(cpu=str(cpu), mem=f"{memory_gib}Gi", gpu=str(n_gpus) if n_gpus else None)


def flyte_ask(a: asks.Ask) -> Ask:
    """`a` in flytekit's types: resources, accelerator, image template, pod template."""
    accelerator = GPUAccelerator(a.accelerator) if a.accelerator else None
    timing = {
        "timeout": timedelta(seconds=a.timeout_s) if a.timeout_s else None,
        "retries": a.retries,
        "interruptible": a.interruptible,
    }
    requests = _resources(a.cpu, a.memory_gib, a.gpus)
    limits = _resources(a.cpu_limit, a.memory_limit_gib, a.gpus)
    if a.sidecar is not None:
        pod = sidecar_pod(a)
        return Ask(requests, limits, accelerator, None, pod, **timing)
    image = IMAGE_OF[a.image]
    pod = None
    if a.shm or a.api_key_secret or a.grace_s:
        pod = model_pod(image, a.gpus, a.shm, a.api_key_secret, a.grace_s)
    return Ask(requests, limits, accelerator, image, pod, **timing)


def task_ask(cfg: RunConfig, task: str, remaining: int | None = None) -> Ask:
    """What `task` asks of a cluster in a run of `cfg` (refused when its image cannot start the
    run's engine)."""
    a = asks.task_ask(cfg, task, remaining)
    problem = asks.image_problem(cfg, task, a.image)
    if problem:
        raise ValueError(problem)
    return flyte_ask(a)


def node_overrides(
    cfg: RunConfig, task: PythonTask, remaining: int | None = None, timeout_s: float = 0
) -> dict[str, Any]:
    """`.with_overrides(**...)` for a node of `task` that a @dynamic starts: the asks of the
    run's own config (for a run with `remaining` steps left) in place of the registration
    config's, its timeout and retries among them (`timeout_s` replaces the timeout). Empty when
    the @dynamic runs locally: its nodes run in this process and nothing is scheduled."""
    ctx = FlyteContextManager.current_context()
    if ctx.compilation_state is None:
        return {}
    name = task.name.rsplit(".", 1)[-1]
    if name in asks.DYNAMICS:
        ask = flyte_ask(asks.dynamic_ask(cfg, name, remaining))
    else:
        ask = task_ask(cfg, name, remaining)
    out: dict[str, Any] = {"requests": ask.requests, "limits": ask.limits}
    out["retries"] = ask.retries
    out["interruptible"] = ask.interruptible
    seconds = timeout_s or (ask.timeout.total_seconds() if ask.timeout else 0)
    if seconds:
        out["timeout"] = timedelta(seconds=seconds)
    if ask.accelerator is not None:
        out["accelerator"] = ask.accelerator
    if ask.image is not None:  # an override is not resolved at serialization, unlike a task's
        images = ctx.serialization_settings.image_config
        out["container_image"] = get_registerable_container_image(ask.image, images)
    if ask.pod_template is not None:
        out["pod_template"] = ask.pod_template
    return out
