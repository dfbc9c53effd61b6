"""The cluster graph, serialized offline as `pyflyte register` would: retries, timeouts, caching,
the nodes of `train` and the nightly launch plan's schedule and inputs (what each task asks of
a cluster: test_cluster_resources.py). No cluster runs here, so these are what a regression would
silently drop."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import msgpack
import pytest
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.deck import DeckField
from flytekit.models.task import Resources as TaskResources
from flytekit.tools.translator import get_serializable

from relax_core.config import RunConfig
from relax_core.ops import asks
from relax_core.run.policy_code import policy_code_version
from tasks.evaluate import evaluate_checkpoint
from tasks.rl import (
    actor_fwd_service,
    advantages_service,
    async_local,
    finish_run,
    policy_spec,
    prepare_data,
    prepare_policy,
    reference_service,
    rl_steps,
    rollout_service,
    sglang_rollout_service,
    start_run,
    trainer_service,
)
from workflows.evaluate import evaluate
from workflows.launch_plans import NIGHTLY_CRON, nightly_grpo
from workflows.train import rl_run, rl_segment, train

TASKS = (prepare_data, policy_spec, prepare_policy, start_run, rl_steps, async_local)
TASKS += (trainer_service, rollout_service, sglang_rollout_service, reference_service)
TASKS += (actor_fwd_service, advantages_service, finish_run, evaluate_checkpoint)

IMAGE = "ghcr.io/relax/relax:v1"
TRAINER_IMAGE = "ghcr.io/relax/relax-trainer:v1"
ROLLOUT_IMAGE = "ghcr.io/relax/relax-rollout:v1"


@pytest.fixture(scope="module")
def settings() -> SerializationSettings:
    # As `pyflyte register --image IMAGE --image trainer=... --image rollout=...` sets them.
    images = [
        Image(name=name, fqn=full.split(":")[0], tag=full.split(":")[1])
        for name, full in (
            ("default", IMAGE),
            ("trainer", TRAINER_IMAGE),
            ("rollout", ROLLOUT_IMAGE),
        )
    ]
    return SerializationSettings(
        image_config=ImageConfig(default_image=images[0], images=images),
        project="relax",
        domain="dev",
        version="v1",
    )


def _template(settings, task):
    return get_serializable(OrderedDict(), settings, task).template


def test_every_task_is_retried_and_bounded_as_its_config_asks(settings):
    # The registration default (no RELAX_CONFIG); timeouts follow the `cluster` section.
    cfg = RunConfig()
    for task in TASKS:
        name = task.name.rsplit(".", 1)[-1]
        t, ask = _template(settings, task), asks.registered_ask(cfg, name)
        assert t.metadata.timeout == timedelta(seconds=ask.timeout_s), name
        assert t.metadata.retries.retries == ask.retries, name
        assert bool(t.metadata.interruptible) == ask.interruptible, name
    t = _template(settings, rl_steps)
    assert t.metadata.retries.retries == 3
    assert t.metadata.interruptible is True  # safe: it resumes from the newest checkpoint
    # pending 1 h + start-up 20 min + 50 steps x 10 min, in whole hours
    c = cfg.cluster
    assert (c.pending_s, c.startup_s, c.step_budget_s) == (3600, 1200, 600)
    assert cfg.train.steps_per_node == 50 and t.metadata.timeout == timedelta(hours=10)
    policy = _template(settings, prepare_policy)
    # Cached on the settings and on the code that prepares policies: an edited warm start
    # is not served the policies the old one made.
    assert policy.metadata.discoverable
    assert policy.metadata.discovery_version == policy_code_version()
    assert _template(settings, evaluate_checkpoint).metadata.retries.retries == 1


def test_the_dynamic_nodes_ask_for_their_pods_and_are_retried(settings):
    for task in (rl_run, rl_segment):
        t = _template(settings, task)
        res = {r.name: r.value for r in t.container.resources.requests}
        lim = {r.name: r.value for r in t.container.resources.limits}
        cpu, mem = TaskResources.ResourceName.CPU, TaskResources.ResourceName.MEMORY
        assert (res[cpu], res[mem], lim[cpu], lim[mem]) == ("1", "1Gi", "2", "1Gi"), task.name
        assert t.metadata.retries.retries == 2, task.name
    # rl_run holds the whole run: its timeout is the run's, from the registration config.
    assert _template(settings, rl_run).metadata.timeout == timedelta(
        seconds=asks.timeout_s(RunConfig(), "rl_run")
    )


def test_finish_run_renders_the_run_report_deck(settings):
    assert _template(settings, finish_run).metadata.generates_deck is True
    # The run report and the task's timeline, inputs and outputs; no `pip list` of the pod.
    assert set(finish_run.deck_fields) == {DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT}


def test_async_role_tasks_are_retried_and_only_rollout_is_interruptible(settings):
    roles = (trainer_service, rollout_service, sglang_rollout_service, reference_service)
    for task in (*roles, advantages_service):
        t = _template(settings, task)
        assert t.metadata.retries.retries == 3, task.name
        # the whole run: pending + start-up + 100 steps x 10 min
        assert t.metadata.timeout == timedelta(hours=18), task.name
    for task in (rollout_service, sglang_rollout_service):
        assert _template(settings, task).metadata.interruptible is True, task.name
    # The trainer holds the optimizer state between checkpoints: not on spot capacity.
    assert not _template(settings, trainer_service).metadata.interruptible


def test_workflows_serialize_with_all_their_nodes(settings):
    wf = get_serializable(OrderedDict(), settings, train)
    ids = {n.id: n for n in wf.template.nodes}
    names = sorted(n.metadata.name for n in ids.values())
    assert names == sorted(
        ["prepare_data", "policy_spec", "prepare_policy", "start_run", "rl_run", "finish_run"]
    )
    # How the steps run is decided in rl_run, from the run's own config.
    (steps,) = (n for n in ids.values() if n.metadata.name == "rl_run")
    inputs = {b.var: b.binding.promise.var for b in steps.inputs}
    assert inputs == {"cfg_json": "cfg_json", "checkpoint": "o0"}
    ev = get_serializable(OrderedDict(), settings, evaluate)
    assert [p for p in ev.template.interface.inputs] == [
        "cfg",
        "checkpoint",
        "model",
        "k",
        "samples",
    ]


def test_nightly_launch_plan_schedule_and_inputs(settings):
    lp = get_serializable(OrderedDict(), settings, nightly_grpo)
    assert lp.spec.entity_metadata.schedule.cron_schedule.schedule == NIGHTLY_CRON == "0 2 * * *"
    assert lp.spec.workflow_id.name == "workflows.train.train"
    assert lp.spec.raw_output_data_config.output_location_prefix == "s3://my-flyte-bucket/relax/raw"
    cfg = lp.spec.default_inputs.parameters["cfg"].default.scalar.binary
    assert cfg.tag == "msgpack"
    values = msgpack.unpackb(cfg.value)
    assert values["run_name"] == "nightly-grpo"
    # Each night starts from the newest registered policy and registers the next version.
    assert values["model"]["kind"] == "pretrained"
    assert values["model"]["source"] == "models:/relax-cpu-default/latest"
    assert values["warm_start"]["steps"] == 0
    assert values["tracking"]["registered_model"] == "relax-cpu-default"
    assert values["tracking"]["experiment"] == "relax-nightly"
    assert values["algorithm"]["loss"] == "grpo"
