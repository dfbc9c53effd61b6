"""The cluster graph, serialized offline as `pyflyte register` would: retries, timeouts, caching,
the branches of `train` and the nightly launch plan's schedule and inputs (what each task asks of
a cluster: test_cluster_resources.py). No cluster runs here, so these are what a regression would
silently drop."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import msgpack
import pytest
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.deck import DeckField
from flytekit.tools.translator import get_serializable

from tasks.evaluate import evaluate_checkpoint
from tasks.rl import (
    advantages_service,
    finish_run,
    prepare_policy,
    reference_service,
    rl_steps,
    rollout_service,
    sglang_rollout_service,
    trainer_service,
)
from workflows.evaluate import evaluate
from workflows.launch_plans import NIGHTLY_CRON, nightly_grpo
from workflows.train import train

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


def test_training_node_is_retried_interruptible_and_bounded(settings):
    t = _template(settings, rl_steps)
    assert t.metadata.retries.retries == 3
    assert t.metadata.interruptible is True  # safe: it resumes from the newest checkpoint
    assert t.metadata.timeout == timedelta(hours=6)
    policy = _template(settings, prepare_policy)
    assert policy.metadata.discoverable and policy.metadata.discovery_version == "1"
    assert policy.metadata.timeout == timedelta(hours=2)
    assert _template(settings, evaluate_checkpoint).metadata.retries.retries == 1


def test_finish_run_renders_the_run_report_deck(settings):
    assert _template(settings, finish_run).metadata.generates_deck is True
    # The run report and the task's timeline, inputs and outputs; no `pip list` of the pod.
    assert set(finish_run.deck_fields) == {DeckField.TIMELINE, DeckField.INPUT, DeckField.OUTPUT}


def test_async_role_tasks_are_retried_and_only_rollout_is_interruptible(settings):
    roles = (trainer_service, rollout_service, sglang_rollout_service, reference_service)
    for task in (*roles, advantages_service):
        t = _template(settings, task)
        assert t.metadata.retries.retries == 3, task.name
        assert t.metadata.timeout == timedelta(hours=12), task.name
    for task in (rollout_service, sglang_rollout_service):
        assert _template(settings, task).metadata.interruptible is True, task.name
    # The trainer holds the optimizer state between checkpoints: not on spot capacity.
    assert not _template(settings, trainer_service).metadata.interruptible


def test_workflows_serialize_with_all_their_nodes(settings):
    wf = get_serializable(OrderedDict(), settings, train)
    ids = {n.id: n for n in wf.template.nodes}
    names = sorted(n.metadata.name for n in ids.values())
    assert names == sorted(
        ["prepare_data", "policy_spec", "prepare_policy", "start_run", "execution", "finish_run"]
    )
    # How the steps run is an explicit branch on prepare_data's `execution` output.
    branch = next(n for n in ids.values() if n.metadata.name == "execution").branch_node.if_else
    cases = [branch.case, *branch.other]
    chosen = {c.condition.comparison.right_value.primitive.string_value: c.then_node for c in cases}
    assert {k: n.metadata.name for k, n in chosen.items()} == {
        "colocate": "rl_loop",
        "async-processes": "async_local",
    }
    assert all(c.condition.comparison.left_value.var.endswith(".execution") for c in cases)
    assert branch.else_node.metadata.name == "async_roles"
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
