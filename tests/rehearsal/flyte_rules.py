"""Flyte's rules on resources, read from what flytekit serializes, applied offline.

    problems = registration_problems(task_templates, RECOMMENDED)  # flyteadmin refuses them
    problems = clamp_problems("rl_run", dynamic_job, RECOMMENDED)   # propeller clamps them
    deadlines = Deadlines.of("rl_steps", node.metadata)             # propeller's timeouts

- registration: flyteadmin's CreateTask validates each task template's requests and limits (a
  container task's container; a pod task's every pod-spec container) against the platform's
  `task_resources.limits` and refuses the task (task_validator.go, validateTaskResources): for
  cpu, memory and ephemeral storage a request above its own limit, a limit above the platform's
  (only where the same resource is also requested) or a request above it; for gpu a request
  unequal to its limit, or above the platform's. Quantities compare as Kubernetes'
  `Quantity.Value()` (rounded up to a whole unit). registration.py serializes what to check.
- clamping: the nodes a @dynamic starts are never validated by flyteadmin; propeller builds their
  pods with every request and limit above the platform's lowered to it, silently (flyteplugins
  container_helper.go, ApplyResourceOverrides; sidecar containers too). A node's container is its
  task template's, each resource replaced by the node's override where it has one.
- deadlines: a node's timeout T gives each attempt an execution deadline T (expired: a
  retryable failure) and the node an active deadline 2T from its first start that no retry
  resets (expired: the node fails); the driver enforces them (driver.py).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.models.task import Resources

from relax_core.ops.flyte_plan import Limits

IMAGES = {name: f"rehearsal/relax-{name}:rehearsal" for name in ("default", "trainer", "rollout")}
_NAMES = {
    Resources.ResourceName.CPU: "cpu",
    Resources.ResourceName.MEMORY: "memory",
    Resources.ResourceName.GPU: "gpu",
    Resources.ResourceName.EPHEMERAL_STORAGE: "ephemeral-storage",
}
_POD_NAMES = {"cpu": "cpu", "memory": "memory", "ephemeral-storage": "ephemeral-storage"}
_POD_NAMES |= {"gpu": "gpu", "nvidia.com/gpu": "gpu", "amd.com/gpu": "gpu"}
_SUFFIXES = {"": 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
_SUFFIXES |= {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}


class RegistrationRefused(RuntimeError):
    """flyteadmin would refuse to register a task; the message names each task and resource."""


class SilentClamp(RuntimeError):
    """propeller would lower a node's resources to the platform's limits without a word."""


def serialization_settings() -> SerializationSettings:
    """As `pyflyte register --image ... --image trainer=... --image rollout=...` sets them."""
    images = [
        Image(name=name, fqn=full.rsplit(":", 1)[0], tag=full.rsplit(":", 1)[1])
        for name, full in IMAGES.items()
    ]
    return SerializationSettings(
        image_config=ImageConfig(default_image=images[0], images=images),
        project="rehearsal",
        domain="development",
        version="rehearsal",
    )


def quantity(value: str) -> Fraction:
    """A Kubernetes quantity ("500m", "96Gi", "2") in base units (cores, bytes, devices)."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|m|k|M|G|T)?", str(value).strip())
    if m is None:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    return Fraction(m[1]) * _SUFFIXES[m[2] or ""]


def _whole(value: str) -> int:
    """Kubernetes' Quantity.Value(): rounded up to a whole unit."""
    return math.ceil(quantity(value))


def platform_limits(limits: Limits) -> dict[str, tuple[Fraction, str]]:
    """flyteadmin's task_resources.limits: resource -> (base units, as an operator writes it)."""
    return {
        "cpu": (Fraction(limits.cpu).limit_denominator(1000), f"{limits.cpu:g}"),
        "memory": (Fraction(limits.memory_gib).limit_denominator(1024) * 2**30,
                   f"{limits.memory_gib:g}Gi"),
        "gpu": (Fraction(limits.gpu), str(limits.gpu)),
    }  # fmt: skip


@dataclass
class Container:
    """One container's asks: resource name ('cpu', 'memory', 'gpu') -> quantity string."""

    name: str
    requests: dict[str, str] = field(default_factory=dict)
    limits: dict[str, str] = field(default_factory=dict)


def _entries(entries: Iterable[Any]) -> dict[str, str]:
    return {_NAMES[e.name]: str(e.value) for e in entries if e.name in _NAMES}


def _pod_resources(resources: dict[str, Any] | None) -> dict[str, str]:
    return {_POD_NAMES[k]: str(v) for k, v in (resources or {}).items() if k in _POD_NAMES}


def pod_containers(pod: Any) -> list[Container]:
    """The containers (init containers among them) of a flyteidl K8sPod with their asks."""
    from google.protobuf.json_format import MessageToDict

    spec = MessageToDict(pod.pod_spec)
    out = []
    for c in [*spec.get("containers", []), *spec.get("initContainers", [])]:
        res = c.get("resources") or {}
        out.append(
            Container(c.get("name", "?"), _pod_resources(res.get("requests")),
                      _pod_resources(res.get("limits")))
        )  # fmt: skip
    return out


def template_containers(template: Any) -> list[Container]:
    """The containers of a flyteidl TaskTemplate (a container task's one, or a pod task's)."""
    if template.HasField("container"):
        res = template.container.resources
        return [Container("primary", _entries(res.requests), _entries(res.limits))]
    if template.HasField("k8s_pod"):
        return pod_containers(template.k8s_pod)
    return []


def admin_problems(task: str, container: Container, limits: Limits) -> list[str]:
    """What flyteadmin's validateTaskResources refuses in one container (it stops at the first;
    every one is listed here). Only requested resources are checked, as there."""
    platform = platform_limits(limits)
    where = f"{task}" + (f" (container {container.name})" if container.name != "primary" else "")
    problems = []
    for res, request in container.requests.items():
        limit = container.limits.get(res)
        plat, plat_text = platform.get(res, (None, ""))
        if res == "gpu":
            if quantity(request) != _whole(request):
                problems.append(f"{where}: gpu request {request} is not a whole number")
            if limit is not None and _whole(limit) != _whole(request):
                problems.append(
                    f"{where}: gpu request {request} differs from its limit {limit} (flyteadmin: "
                    "the default value must equal the limit value)"
                )
        elif limit is not None and _whole(limit) < _whole(request):
            problems.append(f"{where}: {res} request {request} is above its own limit {limit}")
        if plat is None:
            continue
        if limit is not None and res != "gpu" and _whole(limit) > math.ceil(plat):
            problems.append(
                f"{where}: {res} limit {limit} is above the platform's limit {plat_text} "
                f"({limits.describe()}): 'Requested {res.upper()} limit [{limit}] is greater "
                "than current limit set in the platform configuration'"
            )
        if _whole(request) > math.ceil(plat):
            problems.append(
                f"{where}: {res} request {request} is above the platform's limit {plat_text} "
                f"({limits.describe()}): 'Requested {res.upper()} default [{request}] is greater "
                "than current limit set in the platform configuration'"
            )
    return problems


def registration_problems(templates: Iterable[Any], limits: Limits) -> list[str]:
    """What flyteadmin refuses among task templates (flyteidl messages or flytekit models),
    each naming its task."""
    problems = []
    for t in templates:
        t = t if hasattr(t, "HasField") else t.to_flyte_idl()
        for container in template_containers(t):
            problems += admin_problems(t.id.name, container, limits)
    return problems


# --------------------------------------------------------------------------- dynamic nodes


def node_containers(node: Any, templates: dict[str, Any]) -> list[Container]:
    """The containers propeller builds for a task node of a DynamicJobSpec (flyteidl messages:
    flytekit's models drop a node's pod-template override when it has no resource override):
    its task template's, or its pod-template override's, the primary container's resources
    replaced by the node's resource overrides where it has them."""
    template = templates[node.task_node.reference_id.name]
    overrides = node.task_node.overrides
    if overrides.HasField("pod_template"):
        containers = pod_containers(overrides.pod_template)
        primary = overrides.pod_template.primary_container_name
    else:
        containers = template_containers(template)
        primary = template.config.get("primary_container_name", "primary")
    if overrides.HasField("resources"):
        for c in containers:
            if c.name == primary or len(containers) == 1:
                c.requests.update(_entries(overrides.resources.requests))
                c.limits.update(_entries(overrides.resources.limits))
    return containers


def clamps(node_name: str, containers: list[Container], limits: Limits) -> list[str]:
    """Every request or limit of a started node that propeller would lower to the platform's."""
    platform = platform_limits(limits)
    problems = []
    for c in containers:
        where = node_name + (f" (container {c.name})" if len(containers) > 1 else "")
        for kind, asks in (("request", c.requests), ("limit", c.limits)):
            for res, value in asks.items():
                plat, plat_text = platform.get(res, (None, ""))
                if plat is not None and quantity(value) > plat:
                    problems.append(
                        f"{where}: {res} {kind} {value} is above the cluster's limit {plat_text} "
                        f"({limits.describe()}): propeller would clamp it to {plat_text} without "
                        "a word"
                    )
    return problems


def clamp_problems(dynamic: str, job: Any, limits: Limits) -> list[str]:
    """Every silent clamp among the nodes of the DynamicJobSpec (flyteidl message) `dynamic`
    returned."""
    templates = {t.id.name: t for t in job.tasks}
    problems = []
    for node in job.nodes:
        if not node.HasField("task_node"):
            continue
        task = node.task_node.reference_id.name.rsplit(".", 1)[-1]
        name = f"{dynamic} node {node.id} ({task})"
        problems += clamps(name, node_containers(node, templates), limits)
    return problems


# --------------------------------------------------------------------------- deadlines


@dataclass
class Deadlines:
    """One node's deadlines as propeller keeps them (flytepropeller nodes/executor.go): an
    execution deadline of `timeout_s` from each attempt's start (expired: the attempt fails and
    is retried while `retries` last) and an active deadline of twice that from the node's first
    start, which no retry resets (expired: the node fails). timeout_s 0: neither."""

    node: str
    timeout_s: float = 0.0
    retries: int = 0
    first_start: float | None = None
    attempt_start: float = 0.0

    @classmethod
    def of(cls, node: str, metadata: Any) -> Deadlines:
        """From a NodeMetadata (flytekit copies the task's timeout and retries into it, and
        `with_overrides` replaces them)."""
        timeout = metadata.timeout.total_seconds() if metadata and metadata.timeout else 0.0
        retries = metadata.retries.retries if metadata and metadata.retries else 0
        return cls(node, timeout, retries or 0)

    def started(self, at: float) -> None:
        self.attempt_start = at
        if self.first_start is None:
            self.first_start = at

    def active_expired(self, now: float) -> bool:
        return bool(self.timeout_s) and now - (self.first_start or now) >= 2 * self.timeout_s

    def execution_expired(self, now: float) -> bool:
        return bool(self.timeout_s) and now - self.attempt_start >= self.timeout_s

    def active_expiry(self, what: str = "") -> str:
        return (
            f"{self.node}: Timeout in node: its active deadline 2T = {2 * self.timeout_s:g} s "
            f"(timeout T = {self.timeout_s:g} s) from its first start has passed{what}; "
            "propeller fails the node whatever retries are left"
        )
