"""What each Flyte task asks of a cluster, decided from a run config.

The rule: a run is on GPUs when its config names one (`services.accelerator`, e.g. 'nvidia-h100').
A config that names none (every CPU config) asks no GPU anywhere, and all of its tasks run in the
default image. On GPUs, each task that holds the model asks for that accelerator, the trainer
image (CUDA torch + megatron-core) and as many GPUs as its role uses:

    prepare_policy, reference_service, actor_fwd_service     1
    start_run, rl_steps, finish_run, evaluate_checkpoint     1, or the SGLang server's GPUs when
                                                             rollout.engine is sglang (the server
                                                             shares them with the model)
    async_local (every role in one pod)                      trainer_gpus + rollout_workers x
                                                             the GPUs of one engine
    trainer_service                                          trainer_gpus
    rollout_service                                          rollout_gpus
    sglang_rollout_service                                   its sidecar: rollout_gpus (tensor
                                                             parallel) x the --dp-size in
                                                             sglang.extra_args

The tasks that start their rollout engine's server in their own pod (SERVES: the session tasks
and async_local, when rollout.engine is sglang or vllm) run where that engine is installed: the
trainer image holds both in venvs of their own; a CPU-only run's default image holds neither, so
a cluster run of that kind is refused here, naming the settings (such a run is for one machine).

prepare_data, policy_spec and advantages_service are light CPU tasks in every run. CPUs and memory
follow the GPUs (8 CPUs and 64 GiB per GPU, limits 16 and 96 GiB); on a CPU-only run a pod gets
2 CPUs and 8 GiB per process it runs (limits twice that). A pod that holds more than one GPU or
runs an SGLang server gets a memory-backed /dev/shm; the pods that drive SGLang servers in other
pods get the run's API key (tasks/pods.py).

Tasks are decorated when tasks/rl.py is imported, before any run's config exists, so they carry
the asks of the registration config: the YAML file $RELAX_CONFIG names, else the default config
(CPU only). The @dynamic nodes of workflows/train.py give the tasks they start the asks of the
run's own config (`node_overrides`); the static nodes keep the registration config's.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from flytekit import FlyteContextManager, PodTemplate, Resources
from flytekit.core.base_task import PythonTask
from flytekit.core.python_auto_container import get_registerable_container_image
from flytekit.extras.accelerators import GPUAccelerator

from relax_core.config import RunConfig, load_config
from relax_core.ops.placement import demand, sglang_gpus
from relax_core.roles.service import stage_chain
from relax_core.rollout.sglang_lora import lora_flags, versions_kept
from relax_core.rollout.sglang_server import server_flags
from tasks.pods import IMAGE_ENGINES, TRAINER_IMAGE, model_pod, sglang_rollout_pod

CONFIG_ENV = "RELAX_CONFIG"
LIGHT = ("prepare_data", "policy_spec", "advantages_service")
"""Tasks that never hold the model."""
SESSION = ("start_run", "rl_steps", "finish_run", "evaluate_checkpoint")
"""Tasks that hold the model and its rollout engine in one process (an SGLang server among it)."""
MODEL = (*SESSION, "prepare_policy", "async_local", "trainer_service", "rollout_service")
MODEL += ("reference_service", "actor_fwd_service")
TRAINS = ("rl_steps", "async_local", "trainer_service")
"""Tasks that write checkpoints as they train: their pods give SIGTERM the preemption grace."""
TASKS = (*LIGHT, *MODEL, "sglang_rollout_service")
SERVES = (*SESSION, "async_local")
"""Tasks whose pod starts the run's engine server itself (the session's, or async_local's rollout
workers'); sglang_rollout_service's sidecar and the other roles reach theirs over HTTP."""
SERVER_ENGINES = ("sglang", "vllm")
PER_GPU = (8, 64)
"""CPUs and GiB requested per GPU; the limits are PER_GPU_LIMIT."""
PER_GPU_LIMIT = (16, 96)
PER_PROCESS = (2, 8)
"""CPUs and GiB requested per process on a CPU pod (and by light tasks); limits twice that."""
SGLANG_DRIVER = (4, 16)
"""The rollout pod's primary container: tokenizer, rewards and HTTP to its sidecar."""


@dataclass(frozen=True)
class Ask:
    """What one task asks of a cluster."""

    requests: Resources
    limits: Resources
    accelerator: GPUAccelerator | None = None
    image: str | None = None
    """An image template ({{.image.trainer...}}); None = the default image."""
    pod_template: PodTemplate | None = None

    def task_args(self) -> dict[str, Any]:
        """Keyword arguments of `@task`."""
        args: dict[str, Any] = {"requests": self.requests, "limits": self.limits}
        if self.accelerator is not None:
            args["accelerator"] = self.accelerator
        if self.image is not None:
            args["container_image"] = self.image
        if self.pod_template is not None:
            args["pod_template"] = self.pod_template
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
    return task_ask(registration_config(), task).task_args()


def gpus(cfg: RunConfig, task: str) -> int:
    """GPUs the pod of `task` holds (its SGLang sidecar's for sglang_rollout_service)."""
    if task not in TASKS:
        raise ValueError(f"{task!r} is not a task of tasks/rl.py ({', '.join(TASKS)})")
    s = cfg.services
    if not s.accelerator or task in LIGHT:
        return 0
    sglang = cfg.rollout.engine == "sglang"
    per_task = {
        "async_local": sum(n for _, n, _ in demand(cfg)),  # the supervisor's placement
        "trainer_service": s.trainer_gpus,
        "rollout_service": s.rollout_gpus,
        "sglang_rollout_service": sglang_gpus(cfg),
    }
    if task in SESSION and sglang:
        return max(1, sglang_gpus(cfg))
    return per_task.get(task, 1)


def engine_served(cfg: RunConfig, task: str) -> str:
    """The engine whose server `task`'s own pod starts ('' when none)."""
    engine = cfg.rollout.engine
    return engine if engine in SERVER_ENGINES and task in SERVES else ""


def _check_image(cfg: RunConfig, task: str, image: str | None) -> None:
    """Refuses a task that would start an engine its image does not hold."""
    engine = engine_served(cfg, task)
    if engine and engine not in IMAGE_ENGINES[image]:
        raise ValueError(
            f"rollout.engine {engine!r}: the {task} task starts its server, and on a cluster a "
            f"run without services.accelerator runs it in the default image, which holds no "
            f"{engine}; name services.accelerator (the trainer image holds it) or run this "
            f"config on one machine (python -m relax_core.entrypoints.run)"
        )


def _processes(cfg: RunConfig, task: str) -> int:
    """Processes a CPU pod of `task` runs (trainer ranks under torchrun count one each)."""
    s = cfg.services
    if task == "async_local":
        return s.trainer_gpus + s.rollout_workers + len(stage_chain(cfg))
    return s.trainer_gpus if task == "trainer_service" else 1


def _sized(per: tuple[int, int], n: int) -> dict[str, str]:
    return {"cpu": str(per[0] * n), "memory": f"{per[1] * n}Gi"}


def _sizes(cfg: RunConfig, task: str, n_gpus: int) -> tuple[dict[str, str], dict[str, str]]:
    """Requests and limits (cpu, memory) of the pod's model-holding container."""
    if n_gpus:
        return _sized(PER_GPU, n_gpus), _sized(PER_GPU_LIMIT, n_gpus)
    n = 1 if task in LIGHT else _processes(cfg, task)
    return _sized(PER_PROCESS, n), _sized(PER_PROCESS, 2 * n)


def _resources(sizes: dict[str, str], n_gpus: int) -> Resources:
    return Resources(cpu=sizes["cpu"], mem=sizes["memory"], gpu=str(n_gpus) if n_gpus else None)


def task_ask(cfg: RunConfig, task: str) -> Ask:
    """What `task` asks of a cluster in a run of `cfg`."""
    n = gpus(cfg, task)
    accelerator = GPUAccelerator(cfg.services.accelerator) if cfg.services.accelerator else None
    sglang = cfg.rollout.engine == "sglang"
    if task == "sglang_rollout_service":
        lora = lora_flags(cfg.train.lora, versions_kept(cfg))
        args = server_flags(
            cfg.services.rollout_gpus, cfg.sglang, False, cfg.train.routing_replay, lora
        )
        requests, limits = _sizes(cfg, task, n)
        pod = sglang_rollout_pod(args, n, requests, limits, cfg.sglang.api_key_secret)
        driver = _resources(_sized(SGLANG_DRIVER, 1), 0)
        return Ask(driver, _resources(_sized(SGLANG_DRIVER, 2), 0), accelerator, None, pod)
    requests, limits = _sizes(cfg, task, n)
    if task in LIGHT:
        return Ask(_resources(requests, 0), _resources(limits, 0))
    image = TRAINER_IMAGE if n else None
    _check_image(cfg, task, image)
    shm = n > 1 or (sglang and task in (*SESSION, "async_local"))
    key = cfg.sglang.api_key_secret if sglang and task == "trainer_service" else ""
    grace = cfg.services.preemption_grace_s if task in TRAINS else 0
    pod = model_pod(image, n, shm, key, grace) if shm or key or grace else None
    return Ask(
        _resources(requests, n), _resources(limits, n), accelerator if n else None, image, pod
    )


def node_overrides(cfg: RunConfig, task: PythonTask) -> dict[str, Any]:
    """`.with_overrides(**...)` for a node of `task` that a @dynamic starts: the asks of the
    run's own config in place of the registration config's. Empty when the @dynamic runs locally:
    its nodes run in this process and nothing is scheduled."""
    ctx = FlyteContextManager.current_context()
    if ctx.compilation_state is None:
        return {}
    ask = task_ask(cfg, task.name.rsplit(".", 1)[-1])
    out: dict[str, Any] = {"requests": ask.requests, "limits": ask.limits}
    if ask.accelerator is not None:
        out["accelerator"] = ask.accelerator
    if ask.image is not None:  # an override is not resolved at serialization, unlike a task's
        images = ctx.serialization_settings.image_config
        out["container_image"] = get_registerable_container_image(ask.image, images)
    if ask.pod_template is not None:
        out["pod_template"] = ask.pod_template
    return out
