"""The Flyte side of `relax plan --flyte`: what a Flyte 1.16 cluster would refuse, clamp or kill in
a run of a config, checked on any machine before anything is registered or submitted.

What is checked, each problem named with its fix (docs/cluster.md, "Platform settings"):
- resources: every task's requests and limits (the SGLang sidecar's included) against the
  cluster's task resource limits. flyteadmin refuses to register a task over them; a node a
  @dynamic starts skips that check and propeller silently clamps it instead (a trainer asking 8
  GPUs gets 1). The tasks are registered with the registration config's asks (tasks/resources.py)
  and `pyflyte register` registers every task, the ones this run never starts included.
- deadlines: each node's timeout T (per attempt) and 2T (from its first queueing, retries
  included, terminal), from the `cluster` section; a role that gives up waiting for its peers
  before a pod pending for GPUs could start.
- the loop: rl_steps nodes, segments and depth (three levels whatever the length).
- images: the image of every task, and a task that would start an engine its image lacks.
- reachability from pods: run state and tracking on a pod's own disk, a model on a local path.
- parallelism: the role tasks of an async run must all run at once (Flyte's max parallelism).
Notes (not problems): the accelerator's node label, the API key secret, the NVIDIA driver.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from relax_core.config import RunConfig
from relax_core.ops import asks

HOUR = 3600.0
ADMIN_LIMITS = (
    "task_resources.limits.{res} (flyte-core values: "
    "configmap.task_resource_defaults.task_resources.limits.{res}; flyte-binary values: "
    "configuration.inline.task_resources.limits.{res})"
)
PARALLELISM = (
    "pass `--max-parallelism {n}` to `pyflyte run`, or raise flyteadmin.maxParallelism "
    "(flyte-core values: configmap.adminServer.flyteadmin.maxParallelism; flyte-binary values: "
    "configuration.inline.flyteadmin.maxParallelism) to at least {n}"
)
GPU_LABEL = "k8s.amazonaws.com/accelerator"
"""propeller's default gpu-device-node-label (plugins.k8s.gpu-device-node-label)."""
MAX_SEGMENT = 1000
"""Most nodes one @dynamic may hold: every running sub-node's status lives in the execution's
FlyteWorkflow object, which etcd caps at about 1.5 MB."""


@dataclass(frozen=True)
class Limits:
    """A cluster's task resource limits (flyteadmin task_resources.limits) and the executions'
    max parallelism (flyteadmin.maxParallelism)."""

    cpu: float
    memory_gib: float
    gpu: int
    max_parallelism: int = 25
    name: str = ""

    def describe(self) -> str:
        return (
            f"{self.name or 'given'}: cpu {self.cpu:g}, memory {self.memory_gib:g}Gi, "
            f"gpu {self.gpu}, max parallelism {self.max_parallelism}"
        )


STOCK = Limits(2, 1, 1, 25, "stock Flyte 1.16")
"""flyteadmin's defaults (flyteadmin/pkg/runtime/task_resource_provider.go), which the flyte-core
chart's values repeat."""
RECOMMENDED = Limits(128, 768, 8, 25, "docs/cluster.md's")
"""What docs/cluster.md tells the operator to set: one 8-GPU node's worth for one task."""
PRESETS = {"stock": STOCK, "recommended": RECOMMENDED}


def parse_limits(text: str) -> Limits:
    """'stock', 'recommended', or 'cpu=N,memory=NGi,gpu=N[,max_parallelism=N]'."""
    if text in PRESETS:
        return PRESETS[text]
    values: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or key not in ("cpu", "memory", "gpu", "max_parallelism"):
            raise ValueError(
                f"--limits {text!r}: expected stock, recommended or "
                "cpu=N,memory=NGi,gpu=N[,max_parallelism=N]"
            )
        if key == "memory":
            values[key] = _gib(value)
        else:
            values[key] = float(value.removesuffix("m")) / (1000 if value.endswith("m") else 1)
    missing = {"cpu", "memory", "gpu"} - set(values)
    if missing:
        raise ValueError(f"--limits {text!r}: missing {', '.join(sorted(missing))}")
    parallel = int(values.get("max_parallelism", 25))
    return Limits(values["cpu"], values["memory"], int(values["gpu"]), parallel, "given")


def _gib(value: str) -> float:
    units = {"Ti": 1024, "Gi": 1, "Mi": 1 / 1024, "T": 1000**4 / 1024**3, "G": 1000**3 / 1024**3}
    for unit, factor in units.items():
        if value.endswith(unit):
            return float(value[: -len(unit)]) * factor
    return float(value) / 1024**3  # bytes


@dataclass(frozen=True)
class FlytePlan:
    lines: tuple[str, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not self.problems


def _hours(seconds: float) -> str:
    return f"{seconds / HOUR:g} h"


Over = tuple[str, str, float, bool]
"""(resource, task and container, value asked, whether a @dynamic starts it)."""


def _over(ask: asks.Ask, limits: Limits, dynamic: bool) -> list[Over]:
    """What of `ask`'s containers (its SGLang sidecar's included) is over `limits`."""
    containers = [("", ask.cpu_limit, ask.memory_limit_gib, ask.gpus)]
    if ask.sidecar is not None:
        s = ask.sidecar
        containers.append((" (SGLang sidecar)", s.cpu_limit, s.memory_limit_gib, s.gpus))
    allowed = {"cpu": limits.cpu, "memory": limits.memory_gib, "gpu": limits.gpu}
    out = []
    for where, cpu, memory, gpu in containers:  # limits >= requests, so limits decide
        for res, value in (("cpu", cpu), ("memory", memory), ("gpu", gpu)):
            if value > allowed[res]:
                out.append((res, ask.task + where, value, dynamic))
    return out


def _resource_problems(over: list[Over], limits: Limits) -> list[str]:
    """One problem per resource: the tasks over the limit, what Flyte does, the setting."""
    allowed = {"cpu": limits.cpu, "memory": limits.memory_gib, "gpu": limits.gpu}
    problems = []
    for res in ("cpu", "memory", "gpu"):
        items = [(task, value, dynamic) for r, task, value, dynamic in over if r == res]
        if not items:
            continue
        unit = "Gi" if res == "memory" else ""
        named: dict[str, float] = {}
        for task, value, _ in items:
            named[task] = max(value, named.get(task, 0))
        asked = ", ".join(f"{task} {value:g}{unit}" for task, value in named.items())
        refused = sorted({t for t, _, d in items if not d})
        clamped = sorted({t for t, _, d in items if d})
        effects = []
        if refused:
            effects.append(f"flyteadmin refuses to register {', '.join(refused)}")
        if clamped:
            effects.append(
                f"propeller silently clamps {', '.join(clamped)} to {allowed[res]:g}{unit}"
            )
        top = max(named.values())
        problems.append(
            f"{res}: {asked}: over the cluster's task limit {allowed[res]:g}{unit}: "
            f"{'; '.join(effects)}; raise {ADMIN_LIMITS.format(res=res)} to at least "
            f"{top:g}{unit}"
        )
    return problems


def _resources(cfg: RunConfig, limits: Limits) -> tuple[list[str], list[str]]:
    lines = ["tasks (what each pod asks: cpu and memory request/limit; timeout T per attempt):"]
    over: list[Over] = []
    problems: list[str] = []
    no_engine: list[str] = []
    seen: set[str] = set()
    for task in asks.used_tasks(cfg):
        if task in seen:
            continue
        seen.add(task)
        a = asks.task_ask(cfg, task)
        gpu = f", {a.gpus} x {a.accelerator}" if a.gpus else ""
        side = f" + sidecar {a.sidecar.gpus} x {a.accelerator}" if a.sidecar else ""
        lines.append(
            f"  {task:<24} {a.image:<8} cpu {a.cpu}/{a.cpu_limit}, memory "
            f"{a.memory_gib}/{a.memory_limit_gib}Gi{gpu}{side}; T {_hours(a.timeout_s)}, "
            f"retries {a.retries}{', interruptible' if a.interruptible else ''}"
        )
        over += _over(a, limits, task in asks.STARTED)
        if asks.image_problem(cfg, task, a.image):
            no_engine.append(task)
    if no_engine:
        engine = cfg.rollout.engine
        problems.append(
            f"rollout.engine {engine!r}: {', '.join(no_engine)} start its server in their own "
            f"pod, and on a cluster a run without services.accelerator runs them in the default "
            f"image, which holds no {engine}; name services.accelerator (the trainer image "
            "holds it) or run this config on one machine (python -m relax_core.entrypoints.run)"
        )
    for task in (*asks.TASKS, *asks.DYNAMICS):  # `pyflyte register workflows/` registers all
        over += _over(asks.registered_ask(cfg, task), limits, False)
    return lines, _resource_problems(over, limits) + problems


def _deadlines(cfg: RunConfig) -> tuple[list[str], list[str]]:
    c, s = cfg.cluster, cfg.services
    whole = asks.timeout_s(cfg, "rl_run")
    lines = [
        f"deadlines: a step {c.step_budget_s:g} s, pending {c.pending_s:g} s, start-up "
        f"{c.startup_s:g} s (cluster section); rl_run T {_hours(whole)}, killed at 2T = "
        f"{_hours(2 * whole)} from first queueing, retries included"
    ]
    problems = []
    if cfg.mode == "async" and s.launch == "tasks" and s.start_timeout_s < c.pending_s:
        problems.append(
            f"services.start_timeout_s: {s.start_timeout_s:g} s, shorter than cluster.pending_s "
            f"{c.pending_s:g} s: Flyte schedules the role pods one by one (no gang scheduling), "
            "so a role whose trainer pod is still pending gives up first; set "
            f"services.start_timeout_s to at least {c.pending_s:g}"
        )
    if c.step_budget_s < s.preemption_grace_s and cfg.mode == "colocate":
        pass  # a grace longer than a step is fine: the checkpoint waits for the step's end
    return lines, problems


def _loop(cfg: RunConfig) -> tuple[list[str], list[str]]:
    if cfg.mode != "colocate":
        return ["loop: the roles run the whole run; 2 levels (rl_run -> role tasks)"], []
    shape = asks.loop_shape(cfg)
    nodes = sum(shape)
    lines = [
        f"loop: {nodes} rl_steps nodes of {cfg.train.steps_per_node} steps in {len(shape)} "
        f"rl_segment nodes of at most {max(shape, default=0)}; 3 levels deep "
        "(rl_run -> rl_segment -> rl_steps) whatever the length"
    ]
    problems = []
    if max(shape, default=0) > MAX_SEGMENT:
        problems.append(
            f"train.steps_per_node: {cfg.train.steps_per_node} makes {nodes} nodes, "
            f"{max(shape)} in one @dynamic (at most {MAX_SEGMENT}: their statuses share one "
            "etcd object); raise train.steps_per_node"
        )
    return lines, problems


def _local(place: str) -> bool:
    return "://" not in place or place.startswith("file://")


def pod_problems(cfg: RunConfig) -> list[str]:
    """What breaks when every task is its own pod: run state or tracking on a pod's disk."""
    problems = []
    places = {
        "storage.root": cfg.storage.root,
        "queue.root": cfg.queue.root,
        "checkpoint.dir": cfg.checkpoint.dir,
        "checkpoint.policy_cache_dir": cfg.checkpoint.policy_cache_dir,
    }
    for name, place in places.items():
        under_root = name != "storage.root" and place.startswith(cfg.storage.root)
        if _local(place) and not under_root:
            problems.append(
                f"{name}: {place!r} is a pod's own disk on a cluster, gone when the task ends; "
                "set storage.root to an object-store URL such as s3://bucket/prefix"
            )
    uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://", "databricks")):
        problems.append(
            f"tracking.tracking_uri: {uri or '(unset: a SQLite file in the pod)'!r} would give "
            "every pod its own MLflow store; point tracking.tracking_uri (or "
            "MLFLOW_TRACKING_URI) at an MLflow server (http://...)"
        )
    return problems


def _model_problems(cfg: RunConfig) -> list[str]:
    m = cfg.model
    if m.kind != "pretrained" or not m.source:
        return []
    source = m.source
    if source.startswith(("models:", "gguf-package:")) or not _local(source):
        return []
    return [
        f"model.source: {source!r} is a path on this machine, not in a pod's image or disk; "
        "upload the model directory once (e.g. `aws s3 sync <dir> s3://<bucket>/models/<name>`) "
        "and name its URL"
    ]


def _notes(cfg: RunConfig) -> list[str]:
    notes = []
    if cfg.services.accelerator:
        notes.append(
            f"GPU nodes must carry the label {GPU_LABEL}={cfg.services.accelerator} (propeller's "
            "plugins.k8s.gpu-device-node-label; on GKE set it to cloud.google.com/gke-accelerator "
            "and name GKE's value) and tolerate it: propeller adds a required node affinity and a "
            "toleration for it"
        )
        notes.append(
            "the trainer and rollout images are built on CUDA 13: their nodes need NVIDIA driver "
            "R580 or newer"
        )
    if cfg.rollout.engine == "sglang" and cfg.mode == "async" and cfg.services.launch == "tasks":
        notes.append(
            f"the SGLang API key: `kubectl -n <project>-<domain> create secret generic "
            f"{cfg.sglang.api_key_secret} --from-literal=api-key=...` before the run"
        )
    return notes


def flyte_plan(cfg: RunConfig, limits: Limits = STOCK) -> FlytePlan:
    """Every check of the module for a run of `cfg` on a cluster with `limits`."""
    lines = [f"cluster limits ({limits.describe()})"]
    problems: list[str] = []
    for part in (_resources(cfg, limits), _deadlines(cfg), _loop(cfg)):
        lines += part[0]
        problems += part[1]
    problems += pod_problems(cfg) + _model_problems(cfg)
    if cfg.mode == "async" and cfg.services.launch == "tasks":
        roles = len(asks.role_tasks(cfg))
        if roles > limits.max_parallelism:
            problems.append(
                f"services.rollout_workers: the run's {roles} role tasks must all run at once, "
                f"over the max parallelism {limits.max_parallelism}; " + PARALLELISM.format(n=roles)
            )
    return FlytePlan(tuple(lines), tuple(problems), tuple(_notes(cfg)))


def render_flyte(plan: FlytePlan) -> str:
    lines = list(plan.lines)
    if plan.problems:
        lines.append("Flyte would refuse, clamp or kill:")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("Flyte: every task registers and runs within the cluster's limits")
    lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)
