"""The Flyte 2 entry point (flyte2/train.py) run in Flyte 2's local mode, in this process.

- a colocate run gives the held-out accuracies, before and after, of the flytekit `train`
  workflow on the same config bit for bit, through a loop of sibling rl_steps calls (one per
  `steps_per_node` steps, none nested);
- an async run (services.launch: processes) trains through async_local's role processes and
  its queue audit finds no group lost or duplicated;
- a GPU config's calls ask what relax_core/ops/asks.py decides, as tasks/resources.py gives
  flytekit; the nightly trigger carries the nightly recipe on its cron.
"""

from __future__ import annotations

import json
import math
import os
from datetime import timedelta

import pytest
import yaml

from relax_core.config import RunConfig, config_to_dict, load_config, replace
from tests.needs import module

flyte = module("flyte", "pip install -e '.[flyte2]' (the `flyte2` extra)")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


def _shortened(name: str, workdir, policies: str, **sections) -> RunConfig:
    """configs/`name` shortened, from the session's shared warm start, tracked in `workdir`."""
    cfg = load_config(os.path.join(CONFIGS, name))
    return replace(
        cfg,
        checkpoint={"policy_cache_dir": policies},
        tracking={"tracking_uri": f"sqlite:///{workdir / 'mlflow.db'}", "progress": False},
        **sections,
    )


def _write(cfg: RunConfig, path) -> str:
    path.write_text(yaml.safe_dump(config_to_dict(cfg)))
    return str(path)


def _flyte2_train(cfg_path: str, run_dir):
    from flyte2.train import train

    flyte.init()
    run = flyte.with_runcontext(mode="local", run_base_dir=str(run_dir)).run(train, cfg=cfg_path)
    return run.outputs()[0]


@pytest.mark.slow
def test_colocate_run_matches_the_flytekit_workflow_through_sibling_calls(
    workdir, cpu_default_policies, monkeypatch
):
    from tasks import bodies
    from workflows.train import train as flytekit_train

    steps, per_call = 3, 1
    base = _shortened(
        "cpu-default.yaml",
        workdir,
        cpu_default_policies[0],
        data={"eval_size": 32},
        train={"total_steps": steps, "steps_per_node": per_call, "eval_every": 0},
    )
    kit = flytekit_train(cfg=replace(base, storage={"root": str(workdir / "kit")}))

    calls = []
    real = bodies.rl_steps

    def spy(cfg_json: str, checkpoint: str) -> str:
        from relax_core.train.checkpoint import read_state

        calls.append((flyte.ctx().action.name, read_state(checkpoint)["policy_version"]))
        return real(cfg_json, checkpoint)

    monkeypatch.setattr(bodies, "rl_steps", spy)
    two = _write(replace(base, storage={"root": str(workdir / "two")}), workdir / "two.yaml")
    out = _flyte2_train(two, workdir / "flyte-runs")

    assert (out.eval_accuracy_before, out.eval_accuracy_after) == (
        kit.eval_accuracy_before,
        kit.eval_accuracy_after,
    )
    assert 0 < out.eval_accuracy_before < 1  # the warm start: agreeing on it means something
    assert out.steps == kit.steps == steps
    assert out.checkpoint.startswith(str(workdir / "two"))
    # One action per `steps_per_node` steps, each its own sibling call of the driver's loop
    # (the run's length adds calls, never depth).
    assert len(calls) == math.ceil(steps / per_call)
    assert len({action for action, _ in calls}) == len(calls)
    assert [version for _, version in calls] == list(range(steps))


@pytest.mark.slow
def test_async_processes_run_loses_and_repeats_no_group(workdir, cpu_default_policies):
    from relax_core.queue import TransferQueue
    from relax_core.queue.audit import audit_run
    from relax_core.train.checkpoint import read_state

    cfg = _shortened(
        "cpu-async.yaml",
        workdir,
        cpu_default_policies[0],
        data={"eval_size": 16},
        rollout={"groups_per_step": 8},
        train={"total_steps": 3, "eval_every": 0, "checkpoint_every": 1},
        services={"launch": "processes", "trainer_threads": 1, "poll_s": 0.002},
        storage={"root": str(workdir / "async")},
    )
    out = _flyte2_train(_write(cfg, workdir / "async.yaml"), workdir / "flyte-runs")
    state = read_state(out.checkpoint)
    assert out.steps == state["policy_version"] == 3
    audit = audit_run(TransferQueue(cfg.queue.root, state["run_id"]), state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == 3 * 8


def test_a_config_that_is_neither_a_file_nor_json_is_named(workdir):
    from flyte2.train import read_config
    from relax_core.config.load import ConfigError

    with pytest.raises(ConfigError, match="no-such.yaml"):
        read_config("no-such.yaml")
    bad = workdir / "bad.yaml"
    bad.write_text("train: {total_stepz: 3}\n")
    with pytest.raises(ConfigError, match="train.total_stepz: unknown field"):
        read_config(str(bad))
    cpu = os.path.join(CONFIGS, "cpu-default.yaml")
    assert read_config(cpu) == load_config(cpu)
    assert read_config(json.dumps(config_to_dict(load_config(cpu)))) == load_config(cpu)


@pytest.mark.parametrize("task", ["rl_steps", "start_run", "async_local", "trainer_service"])
def test_a_gpu_run_s_calls_ask_what_flytekit_s_nodes_ask(task):
    from flyte2.asks import call_overrides
    from relax_core.ops import asks
    from tasks.resources import task_ask

    cfg = load_config(os.path.join(CONFIGS, "qwen3-4b-8xgpu.yaml"))
    kit = task_ask(cfg, task, 40)
    two = call_overrides(cfg, task, 40)
    r = two["resources"]
    assert r.cpu == (int(kit.requests.cpu), int(kit.limits.cpu))
    assert r.memory == (kit.requests.mem, kit.limits.mem)
    assert r.gpu.quantity == int(kit.requests.gpu) == asks.gpus(cfg, task) > 0
    assert r.gpu.device == kit.accelerator._device == cfg.services.accelerator
    assert two["retries"] == kit.retries and two["interruptible"] == kit.interruptible
    assert two["timeout"] == kit.timeout
    kit_pod, two_pod = kit.pod_template, two.get("pod_template")
    assert (kit_pod is None) == (two_pod is None)
    if kit_pod is not None:
        assert two_pod.primary_container_name == kit_pod.primary_container_name
        assert two_pod.pod_spec.volumes == kit_pod.pod_spec.volumes
        assert two_pod.pod_spec.tolerations == kit_pod.pod_spec.tolerations
        grace = kit_pod.pod_spec.termination_grace_period_seconds
        assert two_pod.pod_spec.termination_grace_period_seconds == grace


def test_the_longest_call_is_bounded_by_its_steps():
    from flyte2.asks import call_overrides

    cfg = load_config(os.path.join(CONFIGS, "qwen3-4b-8xgpu.yaml"))
    short = call_overrides(replace(cfg, train={"steps_per_node": 5}), "rl_steps")["timeout"]
    long = call_overrides(replace(cfg, train={"steps_per_node": 500}), "rl_steps")["timeout"]
    assert timedelta(hours=1) <= short < long


def test_the_nightly_trigger_runs_the_nightly_recipe_on_its_cron():
    from flyte2.train import NIGHTLY, train
    from workflows.nightly import NIGHTLY_CRON, nightly_config

    assert NIGHTLY in train.triggers
    assert NIGHTLY.automation.expression == NIGHTLY_CRON == "0 2 * * *"
    assert NIGHTLY.automation.timezone == "UTC"
    baked = RunConfig.from_json(NIGHTLY.inputs["cfg"])
    assert baked == nightly_config()
    assert baked.model.source == "models:/relax-cpu-default/latest"


def test_a_runs_s3_storage_works_in_a_process_that_imported_flyte(moto_s3, workdir):
    """Importing flyte replaces fsspec's s3 implementation process-wide with obstore's, which
    refuses s3fs's options (`key`, `client_kwargs`) and the "xb" mode queue commits use; the
    run's storage keeps s3fs whatever was registered, so checkpoints, the queue and datasets on
    S3 work inside a Flyte 2 task."""
    import fsspec

    module("flyte.storage", "pip install -e '.[flyte2]'")  # what a Flyte 2 task's I/O loads
    from relax_core.config.filesystems import open_url
    from relax_core.queue.store import ObjectStore

    assert fsspec.get_filesystem_class("s3").__name__.startswith("FsspecStore")  # obstore's
    root = f"s3://{moto_s3.bucket}/flyte2-{os.getpid()}"
    store = ObjectStore(root, moto_s3.storage_options())
    assert type(store.fs).__name__ == "S3FileSystem"
    assert store.create_if_absent("queue/commit-1", b"one")  # the "xb" create
    assert not store.create_if_absent("queue/commit-1", b"two")
    assert store.read_bytes("queue/commit-1") == b"one"
    with open_url(f"{root}/queue/commit-1", "rb", **moto_s3.storage_options()) as f:
        assert f.read() == b"one"  # what datasets and model configs are read with
