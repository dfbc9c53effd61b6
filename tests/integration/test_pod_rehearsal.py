"""Pod rehearsal: the `train` workflow with every task in a pod of its own (tests/rehearsal).

Each task (and each @dynamic's decision) runs in a fresh process with its own network namespace
on a private bridge, an empty tmpfs disk, HOME and TMPDIR, the repo as an overlayfs image and a
read-only root, as Kubernetes pods would. Pods share only a SeaweedFS S3 endpoint and an `mlflow
server` on a "storage" host, and only what a task returns reaches the next one; every output is
checked for local paths. So this is where a run that works on one machine but not on a cluster
fails.

- isolation: a file one pod writes is invisible to the next pod; a pod sees its own name and IP,
  a read-only root and none of the host's loopback services;
- the output check catches a local path, and without it the next pod cannot open that path;
- Flyte's rules (tests/rehearsal/flyte_rules.py): the workflows are serialized as `RELAX_CONFIG=
  <the cluster's config> pyflyte package` would and checked as flyteadmin would against the
  rehearsal cluster's limits (docs/cluster.md's, flyte_plan.RECOMMENDED); every node a @dynamic
  starts is checked for resources propeller would clamp; each node's timeout kills an attempt
  at T and the node at 2T (proved on probe tasks with timeouts of seconds);
- colocate (cpu-default, shortened): one rl_steps pod is killed once it has committed a
  checkpoint and rerun in a fresh pod; the run ends at total_steps with every step logged; the
  nightly launch plan registered with the cluster's config passes prepare_data's preflight in a
  pod, and registered without one (RELAX_CONFIG unset) is refused there;
- async-tasks (cpu-async, shortened): rollout, advantages and trainer pods side by side; the
  trainer is killed after its first checkpoint and rerun; the others end on their own and the
  exactly-once audit (in a pod of its own) finds nothing lost or trained twice.

Needs root and iproute2 for namespaces; elsewhere the rehearsal says so (a warning and a printed
line) and runs plain processes on loopback, which still catches a local path handed on.
"""

from __future__ import annotations

import json
import os
import socket
from collections import OrderedDict
from pathlib import Path

import pytest
import yaml
from flytekit.tools.translator import get_serializable

from relax_core.config import RunConfig, config_from_dict, config_to_dict
from tests.rehearsal.cluster import REPO, open_cluster
from tests.rehearsal.driver import PodError, RehearsalError, kill_after, newer_checkpoint
from tests.rehearsal.flyte_rules import RegistrationRefused, SilentClamp, serialization_settings
from tests.rehearsal.outputs import LocalPathInOutput, check_outputs
from tests.rehearsal.pods import check_interpreter_visible, image_files
from tests.rehearsal.registration import CONFIG_ENV, Package, default_input, register

ROOT_PREFIX = "runs"
"""Both runs share one storage root (each has its own run id under it), so the second run finds
the starting policy the first prepared, as a run on a cluster would."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Network, storage host and pod launcher, shared by the module; where namespaces cannot be
    made, open_network says so (an IsolationUnavailable warning and a printed line)."""
    with open_cluster(tmp_path_factory.mktemp("rehearsal")) as c:
        yield c


@pytest.fixture(scope="module")
def registered(cluster, tmp_path_factory) -> Package:
    """The workflows as this cluster's operator registers them: serialized as `RELAX_CONFIG=
    <the cluster's config> pyflyte package` would (a process of its own, ~5 s of CPU), read
    back. The runs check it against the cluster's limits before their first pod."""
    return register(_config(cluster, "cpu-default.yaml"), tmp_path_factory.mktemp("registration"))


def _config(cluster, name: str, **sections) -> dict:
    """configs/<name> with `sections` merged in, its state under the shared storage root."""
    data = yaml.safe_load(Path(REPO, "configs", name).read_text())
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    data["storage"] = {
        "root": cluster.storage_root(ROOT_PREFIX),
        "endpoint_url": cluster.endpoint_url,
    }
    data.setdefault("tracking", {})["progress"] = False
    return config_to_dict(config_from_dict(data))


def _seed_policy(cluster, root: str, policy_dir: str) -> None:
    """Put a prepared policy into the run's policy cache on the object store, its PREPARED
    marker last, as the prepare_policy task publishes one: a pod then finds it there."""
    from relax_core.run.prepare import MARKER

    target = f"{root}/policies/{os.path.basename(policy_dir)}"
    names = sorted(os.listdir(policy_dir), key=lambda name: name == MARKER)
    for name in names:
        cluster.watch.fs.put_file(os.path.join(policy_dir, name), f"{target}/{name}")


def _logged_steps(tracking_uri: str, run_id: str, key: str) -> tuple[str, set[int]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    status = client.get_run(run_id).info.status
    return status, {m.step for m in client.get_metric_history(run_id, key)}


def _registered_from(tracking_uri: str, model: str) -> list[str]:
    """The MLflow run ids the versions of registered model `model` came from."""
    from mlflow.tracking import MlflowClient

    return [v.run_id for v in MlflowClient(tracking_uri).search_model_versions(f"name='{model}'")]


def _versions(records) -> list[int]:
    return [int(r.outputs["o0"].rsplit("_", 1)[-1]) for r in records if r.outputs]


# --------------------------------------------------------------------------- the harness itself


@pytest.mark.parametrize(
    "outputs",
    [
        {"o0": "/tmp/.relax/checkpoints/cpu-default-1/step_000010"},
        {"o0": ".relax/policies/tiny-6afebec65b2cfb71"},
        {"o0": "file:///tmp/relax-scratch/step_000010"},
        {"o0": "s3://rehearsal/elsewhere/checkpoints/step_000010"},
        {"o0": json.dumps({"model": {"source": "/root/.cache/hf/model"}})},
    ],
)
def test_the_output_check_catches_a_local_path(outputs) -> None:
    with pytest.raises(LocalPathInOutput, match="handed on a place no other pod can see"):
        check_outputs("rl_steps", outputs, "s3://rehearsal/runs", image_files(REPO))


def test_the_output_check_passes_storage_urls_image_files_and_the_config() -> None:
    cfg_json = json.dumps({"checkpoint": {"dir": ".relax/checkpoints"}})
    outputs = {
        "cfg_json": cfg_json,
        "checkpoint": "s3://rehearsal/runs/checkpoints/cpu-default-1/step_000010",
        "spec": json.dumps({"data": {"train_path": "datasets/arithmetic/train.jsonl"}}),
        "tracking": "http://10.0.0.2:5000",
        "model": "models:/relax-cpu-default/3",
        "execution": "async-tasks",
    }
    check_outputs("x", outputs, "s3://rehearsal/runs", image_files(REPO), [cfg_json])


@pytest.mark.parametrize(
    "python, prefix",
    [("/tmp/venv/bin/python3", "/tmp/venv"), ("/usr/bin/python3", "/dev/shm/env")],
)
def test_a_python_that_pods_cannot_see_is_refused_by_name(python, prefix) -> None:
    """Pods mount their own /tmp: a virtualenv there would fail every pod at its first line."""
    with pytest.raises(RuntimeError, match="cannot start pods from /(tmp/venv|dev/shm/env)"):
        check_interpreter_visible(python, prefix)
    check_interpreter_visible("/usr/bin/python3", "/usr")  # where pods see it


@pytest.mark.integration
@pytest.mark.slow
def test_a_file_one_pod_writes_is_invisible_to_the_next_pod(cluster) -> None:
    rehearsal = cluster.rehearsal(cluster.storage_root(ROOT_PREFIX))
    wrote = rehearsal.call("tests.rehearsal.probes:write_local", {"token": "pod-a"})["written"]
    # Isolated, every local place is the pod's own; on the fallback only cwd, HOME and TMPDIR.
    private = set(wrote) if cluster.isolated else {"cwd", "home", "tmpdir"}
    shared = {where: path for where, path in wrote.items() if where not in private}
    try:
        assert {"cwd", "home", "tmpdir"} <= set(wrote), wrote
        seen = rehearsal.call(
            "tests.rehearsal.probes:read_local", {"paths": wrote, "token": "pod-a"}
        )
        assert not any(seen[where] for where in private), f"pod B read what pod A wrote: {seen}"
        for where in private:  # nor does the host (the repo checkout above all)
            path = Path(wrote[where])
            assert not path.exists() or path.read_text() != "pod-a", path
    finally:
        for path in shared.values():  # the fallback's pods write into the host's /tmp
            Path(path).unlink(missing_ok=True)
    if not cluster.isolated:
        print(f"WARNING: isolation checks skipped: {cluster.network.reason}")
        return
    assert not shared
    me = rehearsal.call("tests.rehearsal.probes:whoami", {})
    assert me["resolves_to"] == me["pod_ip"] != "127.0.0.1", me
    assert me["pid"] == 1 and me["tmpdir"] == "/tmp", me
    refused = rehearsal.call("tests.rehearsal.probes:write_local", {"token": "b"})["refused"]
    assert "root" in refused, "a pod could write to the shared root filesystem"
    with socket.create_server(("127.0.0.1", 0)) as server:  # a service on the host's loopback
        probe = {"host": "127.0.0.1", "port": server.getsockname()[1]}
        reached = rehearsal.call("tests.rehearsal.probes:can_connect", probe)
    assert not reached, "a pod reached a service on the host's loopback"
    host, port = cluster.tracking_uri.removeprefix("http://").split(":")
    probe = {"host": host, "port": int(port)}
    assert rehearsal.call("tests.rehearsal.probes:can_connect", probe), "storage unreachable"


@pytest.mark.integration
@pytest.mark.slow
def test_a_task_that_hands_on_a_local_path_fails_the_rehearsal(cluster) -> None:
    from tests.rehearsal.probe_tasks import leaky_pipeline

    root = cluster.storage_root(ROOT_PREFIX)
    with pytest.raises(LocalPathInOutput, match=r"(?s)leaky_checkpoint .*absolute path"):
        cluster.rehearsal(root).run(leaky_pipeline, {})
    # Without the check the next pod fails on the path, as the task would on a cluster.
    with pytest.raises(PodError, match=r"pod read-checkpoint-\d+ exited with code 1") as failed:
        cluster.rehearsal(root, check_outputs=False).run(leaky_pipeline, {})
    assert "FileNotFoundError" in str(failed.value)


@pytest.mark.integration
@pytest.mark.slow
def test_a_node_is_killed_at_its_timeout_retried_and_failed_at_twice_it(cluster) -> None:
    """Propeller's deadlines on a probe task with a timeout of seconds (tasks/ ask hours)."""
    from tests.rehearsal.probe_tasks import STALL_T_S, stalled

    rehearsal = cluster.rehearsal(cluster.storage_root(ROOT_PREFIX))
    with pytest.raises(RehearsalError, match=r"stalls: Timeout in node: its active deadline 2T"):
        rehearsal.run(stalled, {})
    # Attempt 0 was killed at T and retried; the retry was killed at 2T from the first start
    # (before its own T: it started at T or later), with 9 of the node's 10 retries left.
    first, retry = rehearsal.records
    assert first.killed and first.timed_out and first.wall_s >= STALL_T_S, first
    assert retry.killed and not retry.timed_out, retry
    assert "stalls: attempt 0" in Path(first.log).read_text()
    assert "stalls: attempt 1" in Path(retry.log).read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_resources_flyte_would_refuse_or_clamp_fail_the_rehearsal(cluster) -> None:
    from tests.rehearsal.probe_tasks import big_fanout, greedy

    root = cluster.storage_root(ROOT_PREFIX)
    # A node a @dynamic starts above the cluster's limits: compiled in its pod, refused before
    # the node runs, named with its resource, ask and limit.
    rehearsal = cluster.rehearsal(root)
    clamped = r"starts_big node dn0 \(echo\): memory request 1Ti is above the cluster's limit 768Gi"
    with pytest.raises(SilentClamp, match=clamped + " .*clamp it to 768Gi"):
        rehearsal.run(big_fanout, {})
    assert [r.task for r in rehearsal.records] == ["starts_big"]
    # A registered task above them: refused before the first pod, as flyteadmin would.
    template = get_serializable(OrderedDict(), serialization_settings(), greedy).template
    refused = cluster.rehearsal(root, registration=Package({greedy.name: template}, {}, {}))
    with pytest.raises(RegistrationRefused, match="greedy: memory limit 1Ti is above the platform"):
        refused.run(big_fanout, {})
    assert refused.records == []


# --------------------------------------------------------------------------- the train workflow


@pytest.mark.soak
@pytest.mark.timeout(900)  # a whole run in pods, the warm start included
@pytest.mark.integration
@pytest.mark.slow
def test_colocate_run_in_pods_survives_a_killed_rl_steps_pod(
    cluster, registered, cpu_default_policies
) -> None:
    from workflows.train import train

    total = 20  # two rl_steps nodes; the first is killed after its checkpoint at 5
    cfg = _config(
        cluster,
        "cpu-default.yaml",
        train={"total_steps": total, "steps_per_node": 10, "checkpoint_every": 5, "eval_every": 0},
    )
    root = cluster.storage_root(ROOT_PREFIX)
    # The CPU default's warm start, prepared once for the whole suite (tests/policies.py), is in
    # the run's policy cache: the prepare_policy pod finds it, as a second run on a cluster
    # would. The async run below prepares its own in a pod (a cache miss).
    _seed_policy(cluster, root, cpu_default_policies[1])
    faults = [kill_after("rl_steps", newer_checkpoint())]
    rehearsal = cluster.rehearsal(root, faults=faults, registration=registered)
    result = rehearsal.run(train, {"cfg": cfg})

    summary = result.outputs["o0"]
    assert summary["steps"] == total, summary
    assert summary["checkpoint"].startswith(f"{root}/checkpoints/{summary['run_id']}/"), summary
    assert summary["eval_accuracy_after"] > summary["eval_accuracy_before"], summary
    steps = result.pods_of("rl_steps")
    assert [r.killed for r in steps].count(True) == 1, [(r.pod, r.killed) for r in steps]
    done = _versions(steps)
    assert done == sorted(done) and done[-1] == total, done
    # The rerun resumed from what the killed pod committed: every step is logged, none lost.
    status, logged = cluster.on_ctl(
        _logged_steps, cluster.tracking_uri, summary["mlflow_run_id"], "train/reward_mean"
    )
    assert status == "FINISHED"
    assert set(range(1, total + 1)) <= logged, sorted(set(range(1, total + 1)) - logged)
    # The final policy is registered, its files in the object store behind the tracking server.
    sources = cluster.on_ctl(_registered_from, cluster.tracking_uri, "relax-cpu-default")
    assert summary["mlflow_run_id"] in sources, sources
    assert cluster.watch.fs.find(f"{cluster.bucket}/mlflow"), "no model files in the object store"

    # The nightly launch plan, registered with this cluster's config, starts from the version
    # registered above: its baked config passes prepare_data's preflight in a pod (cluster
    # checks on). Registered without a config (this process: RELAX_CONFIG unset) it keeps run
    # state on a pod's disk and is refused there.
    from workflows.launch_plans import nightly_grpo

    assert CONFIG_ENV not in os.environ, f"unset {CONFIG_ENV} to run the rehearsal"
    unset = get_serializable(OrderedDict(), serialization_settings(), nightly_grpo)
    cfgs = {
        "cluster": registered.default_input("nightly_grpo", "cfg", RunConfig),
        "unset": default_input(unset, "cfg", RunConfig),
    }
    refusals = rehearsal.call(
        "tests.rehearsal.checks:preflight",
        {"cfgs": {k: config_to_dict(v) for k, v in cfgs.items()}},
    )
    assert refusals["cluster"] == "", refusals["cluster"]
    assert "storage.root" in refusals["unset"], refusals["unset"]


@pytest.mark.soak
@pytest.mark.timeout(900)  # a whole run in pods, the warm start included
@pytest.mark.integration
@pytest.mark.slow
def test_async_tasks_run_in_pods_survives_a_killed_trainer_and_audits_clean(
    cluster, registered
) -> None:
    from workflows.train import train

    total, groups = 10, 16  # killed after its checkpoint at 5, the rerun trains 6-10
    cfg = _config(
        cluster,
        "cpu-async.yaml",
        train={"total_steps": total, "checkpoint_every": 5, "eval_every": 0},
        data={"eval_size": 128},  # no accuracy claim here: a shorter eval
        # A short warm start of its own: its policy is not in the cache, so the prepare_policy
        # pod builds it and publishes it to the object store (the colocate run's was seeded).
        warm_start={"steps": 10, "target_accuracy": 0.0, "target_per_length": False},
        rollout={"groups_per_step": groups},
        services={"launch": "tasks"},
    )
    root = cluster.storage_root(ROOT_PREFIX)
    faults = [kill_after("trainer_service", newer_checkpoint())]
    rehearsal = cluster.rehearsal(root, faults=faults, grace_s=90, registration=registered)
    result = rehearsal.run(train, {"cfg": cfg})

    summary = result.outputs["o0"]
    assert summary["steps"] == total, summary
    trainers = result.pods_of("trainer_service")
    assert [r.killed for r in trainers] == [True, False], [(r.pod, r.killed) for r in trainers]
    for role in ("rollout_service", "advantages_service"):  # they ended on their own
        assert [r.killed for r in result.pods_of(role)] == [False], role
    audit = rehearsal.call(
        "tests.rehearsal.checks:queue_audit",
        {
            "cfg_json": result.pods_of("prepare_data")[0].outputs["cfg_json"],
            "checkpoint": summary["checkpoint"],
        },
    )
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == total * groups, audit
    assert audit["trained_but_never_generated"] == 0, audit
    [policy] = [r.outputs["o0"] for r in result.pods_of("prepare_policy")]
    assert policy.startswith(f"{root}/policies/") and cluster.watch.exists(
        f"{policy}/model.safetensors"
    )
    status, logged = cluster.on_ctl(
        _logged_steps, cluster.tracking_uri, summary["mlflow_run_id"], "train/reward_mean"
    )
    assert status == "FINISHED" and set(range(1, total + 1)) <= logged, sorted(logged)
