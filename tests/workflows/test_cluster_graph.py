"""The cluster graph, serialized offline as `pyflyte register` would: resources, accelerators,
retries, timeouts, caching and the nightly launch plan's schedule and inputs. No cluster runs
here, so these are what a regression would silently drop."""

from __future__ import annotations

from collections import OrderedDict
from datetime import timedelta

import msgpack
import pytest
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.models.task import Resources as TaskResources
from flytekit.tools.translator import get_serializable

from tasks.evaluate import evaluate_checkpoint
from tasks.rl import finish_run, policy_spec, prepare_data, prepare_policy, rl_steps, start_run
from workflows.evaluate import evaluate
from workflows.launch_plans import NIGHTLY_CRON, nightly_grpo
from workflows.train import train

IMAGE = "ghcr.io/relax/relax:v1"


@pytest.fixture(scope="module")
def settings() -> SerializationSettings:
    image = Image(name="default", fqn=IMAGE.split(":")[0], tag=IMAGE.split(":")[1])
    return SerializationSettings(
        image_config=ImageConfig(default_image=image), project="relax", domain="dev", version="v1"
    )


def _template(settings, task):
    return get_serializable(OrderedDict(), settings, task).template


def _requests(template) -> dict[str, str]:
    names = {v: k for k, v in vars(TaskResources.ResourceName).items() if isinstance(v, int)}
    return {names[r.name]: r.value for r in template.container.resources.requests}


def test_model_holding_tasks_get_a_gpu_and_light_tasks_do_not(settings):
    for task in (prepare_policy, start_run, rl_steps, finish_run):
        t = _template(settings, task)
        assert _requests(t).get("GPU") == "1", (task.name, _requests(t))
        assert t.extended_resources.gpu_accelerator.device == "nvidia-h100", task.name
        assert t.container.image == IMAGE
    for task in (prepare_data, policy_spec):
        assert "GPU" not in _requests(_template(settings, task)), task.name


def test_training_node_is_retried_interruptible_and_bounded(settings):
    t = _template(settings, rl_steps)
    assert t.metadata.retries.retries == 3
    assert t.metadata.interruptible is True  # safe: it resumes from the newest checkpoint
    assert t.metadata.timeout == timedelta(hours=6)
    policy = _template(settings, prepare_policy)
    assert policy.metadata.discoverable and policy.metadata.discovery_version == "1"
    assert policy.metadata.timeout == timedelta(hours=2)
    assert _template(settings, evaluate_checkpoint).metadata.retries.retries == 1


def test_workflows_serialize_with_all_their_nodes(settings):
    wf = get_serializable(OrderedDict(), settings, train)
    ids = {n.id: n for n in wf.template.nodes}
    names = sorted(n.metadata.name for n in ids.values())
    assert names == sorted(
        ["prepare_data", "policy_spec", "prepare_policy", "start_run", "rl_loop", "finish_run"]
    )
    ev = get_serializable(OrderedDict(), settings, evaluate)
    assert [p for p in ev.template.interface.inputs] == ["cfg", "checkpoint", "k", "samples"]


def test_nightly_launch_plan_schedule_and_inputs(settings):
    lp = get_serializable(OrderedDict(), settings, nightly_grpo)
    assert lp.spec.entity_metadata.schedule.cron_schedule.schedule == NIGHTLY_CRON == "0 2 * * *"
    assert lp.spec.workflow_id.name == "workflows.train.train"
    cfg = lp.spec.default_inputs.parameters["cfg"].default.scalar.binary
    assert cfg.tag == "msgpack"
    values = msgpack.unpackb(cfg.value)
    assert values["run_name"] == "cpu-default"
    assert values["checkpoint"]["resume"] is True
    assert values["tracking"]["experiment"] == "relax-nightly"
    assert values["algorithm"]["loss"] == "grpo"
