"""What each Flyte task of a run asks of a cluster, as plain data decided from the run config:
GPUs, CPUs and memory, image, pod needs, timeout, retries, and the shape of the step loop.
tasks/resources.py turns it into flytekit's types; `relax plan --flyte` (ops/flyte_plan.py)
checks it against a cluster's limits and deadlines. No flytekit here.

The rule: a run is on GPUs when its config names one (`services.accelerator`). A config that
names none (every CPU config) asks no GPU anywhere, and all of its tasks run in the default
image. On GPUs, each task that holds the model asks for that accelerator, the trainer image and
as many GPUs as its role uses:

    prepare_policy, reference_service, actor_fwd_service     1
    start_run, rl_steps, finish_run, evaluate_checkpoint     1, or the SGLang server's GPUs when
                                                             rollout.engine is sglang
    async_local (every role in one pod)                      trainer_gpus + rollout_workers x
                                                             the GPUs of one engine
    trainer_service                                          trainer_gpus
    rollout_service                                          rollout_gpus
    sglang_rollout_service                                   its sidecar: rollout_gpus x the
                                                             --dp-size in sglang.extra_args

prepare_data, policy_spec and advantages_service are light CPU tasks in every run, and the
@dynamic nodes of workflows/train.py (they only build the graph) are lighter still. CPUs and
memory follow the GPUs (8 CPUs and 64 GiB per GPU, limits 16 and 96 GiB); on a CPU-only run a
pod gets 2 CPUs and 8 GiB per process it runs (limits twice that).

Timeouts come from the `cluster` section: a node that trains `n` steps gets
pending_s + startup_s + n x step_budget_s (Flyte kills an attempt at T and the node at 2T from
its first queueing, retries included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from relax_core.config import RunConfig
from relax_core.ops.placement import demand, sglang_gpus
from relax_core.roles.service import stage_chain
from relax_core.rollout.sglang_lora import lora_flags, versions_kept
from relax_core.rollout.sglang_server import server_flags

LIGHT = ("prepare_data", "policy_spec", "advantages_service")
"""Tasks that never hold the model."""
SESSION = ("start_run", "rl_steps", "finish_run", "evaluate_checkpoint")
"""Tasks that hold the model and its rollout engine in one process (an SGLang server among it)."""
MODEL = (*SESSION, "prepare_policy", "async_local", "trainer_service", "rollout_service")
MODEL += ("reference_service", "actor_fwd_service")
TRAINS = ("rl_steps", "async_local", "trainer_service")
"""Tasks that write checkpoints as they train: their pods give SIGTERM the preemption grace."""
ROLES = ("trainer_service", "rollout_service", "sglang_rollout_service")
ROLES += ("reference_service", "actor_fwd_service", "advantages_service")
TASKS = (*LIGHT, *MODEL, "sglang_rollout_service")
SERVES = (*SESSION, "async_local")
"""Tasks whose pod starts the run's engine server itself; sglang_rollout_service's sidecar and
the other roles reach theirs over HTTP."""
SERVER_ENGINES = ("sglang", "vllm")
DYNAMICS = ("rl_run", "rl_segment")
"""The @dynamic nodes of workflows/train.py: rl_run builds the steps of the run (segments of
rl_steps nodes, async_local, or the role tasks), rl_segment a chain of rl_steps nodes."""
STARTED = ("rl_steps", "async_local", *ROLES)
"""Tasks only the @dynamic nodes start, with the run's own asks (node overrides)."""
PER_GPU = (8, 64)
"""CPUs and GiB requested per GPU; the limits are PER_GPU_LIMIT."""
PER_GPU_LIMIT = (16, 96)
PER_PROCESS = (2, 8)
"""CPUs and GiB requested per process on a CPU pod (and by light tasks); limits twice that."""
SGLANG_DRIVER = (4, 16)
"""The rollout pod's primary container: tokenizer, rewards and HTTP to its sidecar."""
DYNAMIC_POD = (1, 1, 2, 1)
"""CPU and GiB request, CPU and GiB limit of a @dynamic's pod: it imports the workflow module
(~430 MB) and builds the graph; within stock Flyte's task limits."""
RETRIES = {
    "prepare_data": 0,
    "policy_spec": 0,
    "prepare_policy": 1,
    "start_run": 1,
    "rl_steps": 3,
    "async_local": 1,
    "finish_run": 1,
    "evaluate_checkpoint": 1,
    "rl_run": 2,
    "rl_segment": 2,
    **{role: 3 for role in ROLES},
}
INTERRUPTIBLE = ("rl_steps", "rollout_service", "sglang_rollout_service")
"""Spot capacity: a preempted rl_steps resumes from its newest checkpoint; a restarted rollout
worker reclaims its admission tickets and loses nothing."""
IMAGES = ("default", "trainer", "rollout")
ENGINES_OF_IMAGE = {"default": (), "trainer": ("sglang", "vllm"), "rollout": ("sglang",)}
"""The engine servers each image can start (tests/unit/test_containers.py reads the Dockerfiles)."""
HOUR = 3600.0


@dataclass(frozen=True)
class Sidecar:
    """The SGLang server container of the rollout pod."""

    gpus: int
    cpu: int
    memory_gib: int
    cpu_limit: int
    memory_limit_gib: int
    args: tuple[str, ...]


@dataclass(frozen=True)
class Ask:
    """What one task (or one @dynamic's pod) asks of a cluster."""

    task: str
    cpu: int
    memory_gib: int
    cpu_limit: int
    memory_limit_gib: int
    gpus: int = 0
    accelerator: str = ""
    image: str = "default"
    shm: bool = False
    """A memory-backed /dev/shm (NCCL between a pod's GPUs, SGLang's workers)."""
    api_key_secret: str = ""
    """The run's secret whose API key the pod's container gets (it drives SGLang servers)."""
    grace_s: float = 0.0
    """Seconds between SIGTERM and SIGKILL (a training task writes its checkpoint)."""
    sidecar: Sidecar | None = None
    timeout_s: float = 0.0
    retries: int = 0
    interruptible: bool = False
    notes: tuple[str, ...] = field(default=())


def gpus(cfg: RunConfig, task: str) -> int:
    """GPUs the pod of `task` holds (its SGLang sidecar's for sglang_rollout_service)."""
    if task not in TASKS:
        raise ValueError(f"{task!r} is not a task of tasks/rl.py ({', '.join(TASKS)})")
    s = cfg.services
    if not s.accelerator or task in LIGHT:
        return 0
    per_task = {
        "async_local": sum(n for _, n, _ in demand(cfg)),  # the supervisor's placement
        "trainer_service": s.trainer_gpus,
        "rollout_service": s.rollout_gpus,
        "sglang_rollout_service": sglang_gpus(cfg),
    }
    if task in SESSION and cfg.rollout.engine == "sglang":
        return max(1, sglang_gpus(cfg))
    return per_task.get(task, 1)


def engine_served(cfg: RunConfig, task: str) -> str:
    """The engine whose server `task`'s own pod starts ('' when none)."""
    engine = cfg.rollout.engine
    return engine if engine in SERVER_ENGINES and task in SERVES else ""


def image_problem(cfg: RunConfig, task: str, image: str) -> str:
    """Why `task` cannot run in `image` ('' when it can): it would start an engine not there."""
    engine = engine_served(cfg, task)
    if engine and engine not in ENGINES_OF_IMAGE[image]:
        return (
            f"rollout.engine {engine!r}: the {task} task starts its server, and on a cluster a "
            f"run without services.accelerator runs it in the default image, which holds no "
            f"{engine}; name services.accelerator (the trainer image holds it) or run this "
            f"config on one machine (python -m relax_core.entrypoints.run)"
        )
    return ""


def _processes(cfg: RunConfig, task: str) -> int:
    """Processes a CPU pod of `task` runs (trainer ranks under torchrun count one each)."""
    s = cfg.services
    if task == "async_local":
        return s.trainer_gpus + s.rollout_workers + len(stage_chain(cfg))
    return s.trainer_gpus if task == "trainer_service" else 1


def _sizes(cfg: RunConfig, task: str, n_gpus: int) -> tuple[int, int, int, int]:
    """CPU and GiB requests, CPU and GiB limits of the pod's model-holding container."""
    if n_gpus:
        return (PER_GPU[0] * n_gpus, PER_GPU[1] * n_gpus) + (
            PER_GPU_LIMIT[0] * n_gpus,
            PER_GPU_LIMIT[1] * n_gpus,
        )
    n = 1 if task in LIGHT else _processes(cfg, task)
    return PER_PROCESS[0] * n, PER_PROCESS[1] * n, PER_PROCESS[0] * 2 * n, PER_PROCESS[1] * 2 * n


def budget_s(cfg: RunConfig, steps: int) -> float:
    """One attempt of a node that trains `steps` steps: pending, start-up, the steps."""
    c = cfg.cluster
    return c.pending_s + c.startup_s + steps * c.step_budget_s


def remaining_steps(cfg: RunConfig, version: int = 0) -> int:
    return max(0, cfg.train.total_steps - version)


def timeout_s(cfg: RunConfig, task: str, remaining: int | None = None) -> float:
    """The timeout of one attempt of `task` in a run with `remaining` steps to train (None:
    the whole run). Whole hours, at least one."""
    left = remaining_steps(cfg) if remaining is None else remaining
    c = cfg.cluster
    if task in ("prepare_data", "policy_spec"):
        seconds = HOUR
    elif task == "prepare_policy":  # a warm start or a conversion, on a GPU it may wait for
        seconds = c.pending_s + c.startup_s + 2 * HOUR
    elif task in ("start_run", "finish_run", "evaluate_checkpoint"):  # an eval, a checkpoint
        seconds = budget_s(cfg, 2)
    elif task == "rl_steps":
        seconds = budget_s(cfg, cfg.train.steps_per_node)
    elif task == "rl_segment":
        raise ValueError("rl_segment's timeout depends on its nodes: segment_timeout_s")
    elif task == "rl_run":
        seconds = run_timeout_s(cfg, left)
    else:  # async_local and the roles run the whole (rest of the) run
        seconds = budget_s(cfg, left)
    return float(max(HOUR, math.ceil(seconds / HOUR) * HOUR))


def loop_shape(cfg: RunConfig, remaining: int | None = None) -> list[int]:
    """The colocate loop: rl_steps nodes per rl_segment, for a run with `remaining` steps to
    train. N nodes go in ceil(sqrt(N)) segments of at most ceil(sqrt(N)) nodes, so the graph is
    three levels deep (rl_run -> rl_segment -> rl_steps) whatever the run's length, and no
    @dynamic holds more than about sqrt(N) nodes (80 nodes: 9 segments of at most 9)."""
    left = remaining_steps(cfg) if remaining is None else remaining
    nodes = math.ceil(left / cfg.train.steps_per_node)
    if nodes == 0:
        return []
    width = math.ceil(math.sqrt(nodes))
    shape = [width] * (nodes // width)
    return shape + [nodes % width] if nodes % width else shape


def segment_timeout_s(cfg: RunConfig, nodes: int) -> float:
    """An rl_segment runs `nodes` rl_steps nodes one after another, each of which may pend."""
    return nodes * timeout_s(cfg, "rl_steps")


def run_timeout_s(cfg: RunConfig, remaining: int) -> float:
    """rl_run holds every step node of the run (colocate) or every role (async)."""
    if cfg.mode == "colocate":
        return sum(segment_timeout_s(cfg, n) for n in loop_shape(cfg, remaining)) or HOUR
    return budget_s(cfg, remaining)


def used_tasks(cfg: RunConfig) -> tuple[str, ...]:
    """The tasks a run of `cfg` starts (the dynamic nodes' among them)."""
    used = ["prepare_data", "policy_spec", "prepare_policy", "start_run", "finish_run"]
    if cfg.mode == "colocate":
        used.append("rl_steps")
    elif cfg.services.launch == "processes":
        used.append("async_local")
    else:
        used += role_tasks(cfg)
    return tuple(used)


def role_tasks(cfg: RunConfig) -> list[str]:
    """The role tasks of an async-tasks run, one per rollout worker among them."""
    rollout = "sglang_rollout_service" if cfg.rollout.engine == "sglang" else "rollout_service"
    roles = [rollout] * cfg.services.rollout_workers
    roles += [f"{role}_service" for role, _, _ in stage_chain(cfg)]
    return [*roles, "trainer_service"]


def dynamic_ask(cfg: RunConfig, task: str, remaining: int | None = None) -> Ask:
    """The pod of a @dynamic node (it builds the graph; its children run in pods of their own)."""
    cpu, mem, cpu_limit, mem_limit = DYNAMIC_POD
    timeout = timeout_s(cfg, "rl_run", remaining) if task == "rl_run" else 0.0
    return Ask(task, cpu, mem, cpu_limit, mem_limit, timeout_s=timeout, retries=RETRIES[task])


def task_ask(cfg: RunConfig, task: str, remaining: int | None = None) -> Ask:
    """What `task` asks of a cluster in a run of `cfg` with `remaining` steps to train."""
    n = gpus(cfg, task)
    accelerator = cfg.services.accelerator
    sglang = cfg.rollout.engine == "sglang"
    timing = {
        "timeout_s": timeout_s(cfg, task, remaining),
        "retries": RETRIES[task],
        "interruptible": task in INTERRUPTIBLE,
    }
    if task == "sglang_rollout_service":
        lora = lora_flags(cfg.train.lora, versions_kept(cfg))
        args = server_flags(
            cfg.services.rollout_gpus, cfg.sglang, False, cfg.train.routing_replay, lora
        )
        sidecar = Sidecar(n, *_sizes(cfg, task, n), tuple(args))
        d = SGLANG_DRIVER
        return Ask(
            task, d[0], d[1], 2 * d[0], 2 * d[1], 0, accelerator, "default", True,
            cfg.sglang.api_key_secret, sidecar=sidecar, **timing,
        )  # fmt: skip
    cpu, mem, cpu_limit, mem_limit = _sizes(cfg, task, n)
    if task in LIGHT:
        return Ask(task, cpu, mem, cpu_limit, mem_limit, **timing)
    shm = n > 1 or (sglang and task in SERVES)
    return Ask(
        task,
        cpu,
        mem,
        cpu_limit,
        mem_limit,
        n,
        accelerator if n else "",
        "trainer" if n else "default",
        shm,
        cfg.sglang.api_key_secret if sglang and task == "trainer_service" else "",
        cfg.services.preemption_grace_s if task in TRAINS else 0.0,
        **timing,
    )


def registered_ask(cfg: RunConfig, task: str) -> Ask:
    """The ask `task` is registered with under the registration config `cfg`. A task only the
    @dynamic nodes start, and which a run of `cfg` never starts, is registered light (2 CPUs,
    8 GiB): each run's own asks reach it through node overrides, and an async_local asking 16
    GPUs for a run that never uses it would be refused by the cluster's limits."""
    if task in DYNAMICS:
        return dynamic_ask(cfg, task)
    if task in STARTED and task not in used_tasks(cfg):
        light = task_ask(cfg, "advantages_service")
        return Ask(
            task, light.cpu, light.memory_gib, light.cpu_limit, light.memory_limit_gib,
            timeout_s=timeout_s(cfg, task), retries=RETRIES[task],
            interruptible=task in INTERRUPTIBLE,
        )  # fmt: skip
    return task_ask(cfg, task)
