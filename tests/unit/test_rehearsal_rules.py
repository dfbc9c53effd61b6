"""The Flyte rules the pod rehearsal applies (tests/rehearsal/flyte_rules.py),
on small tasks serialized in-process: what flyteadmin refuses to register, what propeller clamps
in a @dynamic's nodes, and when a node's deadlines expire. The rehearsal itself runs them on the
`train` workflow (tests/integration/test_pod_rehearsal.py)."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta
from fractions import Fraction

import pytest
from flytekit import Resources, dynamic, task
from flytekit.models.core.workflow import NodeMetadata
from flytekit.models.literals import RetryStrategy
from flytekit.tools.translator import get_serializable

from relax_core.ops.flyte_plan import RECOMMENDED, STOCK
from tasks.pods import sglang_rollout_pod
from tests.rehearsal import graph
from tests.rehearsal.flyte_rules import (
    Deadlines,
    clamp_problems,
    quantity,
    registration_problems,
    serialization_settings,
)
from tests.rehearsal.pod_main import record_plan

# The rollout pod with an SGLang sidecar on 16 GPUs (RECOMMENDED allows 8 per task).
WIDE_POD = sglang_rollout_pod(["--tp-size", "16"], 16, {"cpu": "4"}, {"cpu": "8"}, "")


@task(requests=Resources(cpu="16", mem="1Ti"), limits=Resources(cpu="200", mem="1Ti"))
def greedy() -> int:
    return 0


@task(
    requests=Resources(cpu="4", mem="16Gi", gpu="8"), limits=Resources(cpu="8", mem="32Gi", gpu="8")
)
def fits() -> int:
    return 0


@task(requests=Resources(cpu="2", mem="8Gi"), limits=Resources(cpu="4", mem="16Gi"))
def step(x: int) -> int:
    return x


@task(requests=Resources(cpu="4"), limits=Resources(cpu="8"), pod_template=WIDE_POD)
def wide() -> int:
    return 0


@dynamic
def fan(n: int) -> int:
    big = Resources(cpu="4", mem="1Ti", gpu="16")
    first = step(x=n).with_overrides(requests=Resources(cpu="2", mem="8Gi", gpu="16"), limits=big)
    step(x=n).with_overrides(pod_template=WIDE_POD)
    return step(x=first)


def _template(entity):
    return get_serializable(OrderedDict(), serialization_settings(), entity).template


def test_quantities_read_as_kubernetes_writes_them():
    assert quantity("500m") == Fraction(1, 2)
    assert quantity("96Gi") == 96 * 2**30
    assert quantity("1G") == 10**9
    assert quantity("2") == 2
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity("lots")


def test_flyteadmin_refuses_a_task_above_the_platform_limits_naming_each_resource():
    problems = registration_problems([_template(greedy), _template(fits)], RECOMMENDED)
    name = greedy.name
    assert len(problems) == 3, problems
    assert problems[0].startswith(f"{name}: cpu limit 200 is above the platform's limit 128 ")
    assert problems[1].startswith(f"{name}: memory limit 1Ti is above the platform's limit 768Gi")
    assert problems[2].startswith(f"{name}: memory request 1Ti is above the platform's limit 768")
    # A request under its limit but above the platform's is refused too; stock Flyte's 2 CPUs
    # refuse `fits` (8 GPUs, 32 GiB) as well.
    stock = registration_problems([_template(fits)], STOCK)
    assert {p.split(" is above")[0] for p in stock} == {
        f"{fits.name}: {what}"
        for what in ("cpu limit 8", "cpu request 4", "memory limit 32Gi", "memory request 16Gi",
                     "gpu request 8")
    }  # fmt: skip


def test_flyteadmin_checks_every_container_of_a_pod_task():
    problems = registration_problems([_template(wide)], RECOMMENDED)
    assert len(problems) == 1, problems
    assert "(container sglang)" in problems[0] or "(container " in problems[0], problems
    assert "gpu request 16 is above the platform's limit 8" in problems[0], problems


def test_a_request_above_its_own_limit_and_a_gpu_request_unequal_to_its_limit_are_refused():
    @task(requests=Resources(cpu="8", gpu="2"), limits=Resources(cpu="4", gpu="1"))
    def inverted() -> int:
        return 0

    problems = registration_problems([_template(inverted)], RECOMMENDED)
    assert any("cpu request 8 is above its own limit 4" in p for p in problems), problems
    assert any("gpu request 2 differs from its limit 1" in p for p in problems), problems


def test_a_dynamic_node_above_the_cluster_limits_is_a_silent_clamp_named_by_node():
    plan = record_plan(fan, {"n": 3})
    job, message, _ = graph.decode_plan(plan)
    assert [n.id for n in job.nodes] == ["dn0", "dn1", "dn2"]
    assert graph.upstream(job.nodes[2]) == {"dn0"}
    assert graph.bindings(job.nodes[0], {}) == {"x": 3}
    problems = clamp_problems("fan", message, RECOMMENDED)
    assert [p.split(": ", 1)[0] for p in problems] == [
        "fan node dn0 (step)",
        "fan node dn0 (step)",
        "fan node dn0 (step)",
        *["fan node dn1 (step) (container " + p.split("(container ")[1].split(")")[0] + ")"
          for p in problems[3:]],
    ]  # fmt: skip
    assert "gpu request 16 is above the cluster's limit 8" in problems[0], problems
    assert "propeller would clamp it to 8" in problems[0], problems
    assert "memory limit 1Ti is above the cluster's limit 768Gi" in problems[1], problems
    assert "gpu limit 16" in problems[2], problems
    assert problems[3:] and all("gpu" in p for p in problems[3:]), problems  # the sidecar
    # The node without overrides keeps its task's asks: within the limits.
    assert not any("dn2" in p for p in problems)


def test_deadlines_kill_an_attempt_at_t_and_the_node_at_2t_from_its_first_start():
    d = Deadlines.of("rl_steps", NodeMetadata("rl_steps", timedelta(seconds=10), RetryStrategy(3)))
    assert (d.timeout_s, d.retries) == (10, 3)
    d.started(100.0)
    assert not d.execution_expired(109.9) and d.execution_expired(110.0)
    d.started(110.5)  # the retry: a new execution deadline, the same active one
    assert not d.execution_expired(120.0) and d.execution_expired(120.5)
    assert not d.active_expired(119.9) and d.active_expired(120.0)
    assert "rl_steps: Timeout in node: its active deadline 2T = 20 s" in d.active_expiry()
    none = Deadlines.of("x", NodeMetadata("x", timedelta(0), RetryStrategy(0)))
    none.started(0.0)
    assert not none.execution_expired(1e9) and not none.active_expired(1e9)
