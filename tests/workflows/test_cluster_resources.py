"""What a cluster is asked for, from the run config (tasks/resources.py), checked offline.

Registration: docs/cluster.md's `RELAX_CONFIG=my-cluster.yaml pyflyte --pkgs workflows package ...`
is run as written for three configs (tests/workflows/conftest.py), and the packaged task
templates are read back: a CPU config asks no GPU anywhere; a GPU
config asks each role's GPUs, the accelerator, the trainer image, /dev/shm where NCCL or SGLang
need it, and starts the SGLang sidecar on the pod's address with its tensor parallel, R3 flag
and API key. Runs: the @dynamic nodes give the tasks they start the run's own config's asks,
whatever config the workflows were registered with.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from datetime import timedelta

import pytest
from flytekit import dynamic
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.extras import accelerators
from flytekit.models.task import Resources as TaskResources

from relax_core.config import RunConfig, config_to_dict, load_config, replace
from relax_core.config.checks_gpu import ACCELERATORS
from relax_core.ops import asks, placement
from tasks import resources
from tasks.rl import rl_steps
from tests.workflows.conftest import IMAGES, REPO
from workflows.train import rl_run, rl_segment

SERVE = os.path.join(REPO, "containers", "rollout", "serve.sh")
GPU_NAMES = {"gpu", "nvidia.com/gpu"}


def _cfg(name: str) -> RunConfig:
    return load_config(os.path.join(REPO, "configs", f"{name}.yaml"))


def _containers(t) -> dict[str, dict]:
    """name -> container as a pod spec shows it (a plain task: its one container)."""
    if t.k8s_pod is not None:
        return {c["name"]: c for c in t.k8s_pod.pod_spec["containers"]}
    names = {v: k for k, v in vars(TaskResources.ResourceName).items() if isinstance(v, int)}
    res = t.container.resources
    requests = {names[r.name].lower(): r.value for r in res.requests}
    limits = {names[r.name].lower(): r.value for r in res.limits}
    resources = {"requests": requests, "limits": limits}
    return {"primary": {"image": t.container.image, "resources": resources}}


def _gpus(t) -> dict[str, int]:
    """GPUs each container requests (and limits to the same count)."""
    out = {}
    for name, c in _containers(t).items():
        res = c.get("resources") or {}
        req = {k: v for k, v in (res.get("requests") or {}).items() if k in GPU_NAMES}
        lim = {k: v for k, v in (res.get("limits") or {}).items() if k in GPU_NAMES}
        assert list(req.values()) == list(lim.values()), (name, res)
        out[name] = int(next(iter(req.values()), 0))
    return out


def _accelerator(t) -> str:
    ext = t.extended_resources
    return ext.gpu_accelerator.device if ext is not None and ext.HasField("gpu_accelerator") else ""


def _shm(pod_spec: dict | None, container: str = "primary") -> bool:
    """Whether `container` has a memory-backed /dev/shm."""
    if not pod_spec:
        return False
    volumes = pod_spec.get("volumes") or []
    memory = {v["name"] for v in volumes if v.get("emptyDir", {}).get("medium") == "Memory"}
    c = next(c for c in pod_spec["containers"] if c["name"] == container)
    mounts = c.get("volumeMounts") or []
    return any(m["mountPath"] == "/dev/shm" and m["name"] in memory for m in mounts)


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


@pytest.mark.slow
def test_a_cpu_config_asks_no_gpu_anywhere(packaged):
    tasks = {k: v for k, v in packaged["cpu-default"].items() if k != "launch_plans"}
    assert set(resources.TASKS) <= set(tasks)  # every task of tasks/rl.py and evaluate
    for name, t in tasks.items():
        assert not any(_gpus(t).values()), (name, _gpus(t))
        assert _accelerator(t) == "", name
        assert _containers(t)["primary"]["image"] == IMAGES["default"], name
        if t.k8s_pod is not None:
            assert not t.k8s_pod.pod_spec.get("tolerations"), name
    # The registration default (no RELAX_CONFIG: RunConfig()) is CPU only too.
    assert not any(resources.gpus(RunConfig(), task) for task in resources.TASKS)


def test_an_8_gpu_node_run_asks_for_the_node(packaged):
    cfg, tasks = _cfg("qwen3-4b-8xgpu"), packaged["qwen3-4b-8xgpu"]
    # services.launch: processes: one pod holds every role, 1 trainer + 7 SGLang engines.
    local = tasks["async_local"]
    assert _gpus(local) == {"primary": 8} and _accelerator(local) == "nvidia-h100"
    assert _containers(local)["primary"]["image"] == IMAGES["trainer"]
    assert _shm(local.k8s_pod.pod_spec)
    # The role tasks this run never starts are registered light: no GPU, the default image
    # (an 8-GPU trainer task would be refused by a cluster sized for this run for nothing).
    roles = ("trainer_service", "rollout_service", "sglang_rollout_service")
    for name in (*roles, "reference_service", "actor_fwd_service", "advantages_service"):
        assert _gpus(tasks[name]) == {"primary": 0} and _accelerator(tasks[name]) == "", name
        assert _containers(tasks[name])["primary"]["image"] == IMAGES["default"], name
        assert tasks[name].k8s_pod is None, name
    for name in ("prepare_data", "policy_spec"):
        assert _gpus(tasks[name]) == {"primary": 0} and _accelerator(tasks[name]) == "", name
        assert _containers(tasks[name])["primary"]["image"] == IMAGES["default"], name
    for name in ("prepare_policy", "start_run", "finish_run"):
        assert _gpus(tasks[name]) == {"primary": 1}, name
        assert _containers(tasks[name])["primary"]["image"] == IMAGES["trainer"], name
    assert cfg.services.launch == "processes"


def test_the_r3_run_asks_its_trainer_gpus_and_tensor_parallel_sglang_pods(packaged):
    cfg, tasks = _cfg("qwen3-30b-a3b-moe-r3"), packaged["qwen3-30b-a3b-moe-r3"]
    trainer = tasks["trainer_service"]
    assert _gpus(trainer) == {"primary": 8} and _accelerator(trainer) == "nvidia-h100"
    spec = trainer.k8s_pod.pod_spec
    assert _shm(spec)  # NCCL between the pod's 8 GPUs
    key = _env(spec["containers"][0])["RELAX_SGLANG_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert key == {"name": "relax-sglang", "key": "api-key"}  # to drive the servers' updates
    pod = tasks["sglang_rollout_service"]
    assert _gpus(pod) == {"primary": 0, "sglang": 4} and _accelerator(pod) == "nvidia-h100"
    spec = pod.k8s_pod.pod_spec
    primary, sidecar = (_containers(pod)[n] for n in ("primary", "sglang"))
    assert primary["image"] == IMAGES["default"] and sidecar["image"] == IMAGES["rollout"]
    assert _shm(spec, "sglang")
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    # The rollout service publishes the pod's address, not loopback: RELAX_POD_IP (the downward
    # API) is defined before the URL that Kubernetes expands it in.
    env = _env(primary)
    names = [e["name"] for e in primary["env"]]
    assert env["RELAX_POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env["RELAX_SGLANG_URL"]["value"] == "http://$(RELAX_POD_IP):30000"
    assert names.index("RELAX_POD_IP") < names.index("RELAX_SGLANG_URL")
    assert env["RELAX_SGLANG_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "relax-sglang"
    # SGLang's /health generates a token: at least a second, past a 1 s probe; /ready is cheap.
    assert sidecar["readinessProbe"]["httpGet"] == {"path": "/ready", "port": 30000}
    assert sidecar["readinessProbe"]["timeoutSeconds"] >= 2
    # The primary runs the rollout service; both see the policy directory it writes.
    assert "sglang_rollout_service" in primary["args"]
    assert sidecar["command"] == ["/opt/relax/serve.sh"]
    for c in (primary, sidecar):
        assert {"name": "models", "mountPath": "/models"} in c["volumeMounts"]
    assert _env(sidecar)["RELAX_MODEL_DIR"] == env["RELAX_MODEL_DIR"]
    # What the sidecar starts: serve.sh run with the pod's arguments and environment.
    argv = _serve(sidecar, key="per-run-key")
    flags = {a: b for a, b in zip(argv, argv[1:], strict=False) if a.startswith("--")}
    assert flags["--host"] == "0.0.0.0" and flags["--port"] == "30000"
    assert flags["--tp-size"] == str(cfg.services.rollout_gpus) == "4"
    assert flags["--api-key"] == "per-run-key"
    assert flags["--mem-fraction-static"] == str(cfg.sglang.mem_fraction_static)
    assert "--enable-return-routed-experts" in argv  # train.routing_replay: R3


def _serve(sidecar: dict, key: str) -> list[str]:
    """The `sglang.launch_server` arguments serve.sh gives with the sidecar's args and env."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        model, record = os.path.join(tmp, "policy"), os.path.join(tmp, "argv")
        os.makedirs(model)
        open(os.path.join(model, "READY"), "w").close()
        fake = os.path.join(tmp, "python3")
        with open(fake, "w") as f:
            f.write(f'#!/bin/sh\nfor a in "$@"; do echo "$a"; done > {record}\n')
        os.chmod(fake, 0o755)
        env = {e["name"]: e["value"] for e in sidecar["env"] if "value" in e}
        env.update(PATH=f"{tmp}:{os.environ['PATH']}", RELAX_MODEL_DIR=model)
        env["RELAX_SGLANG_API_KEY"] = key  # the secret's value, as the kubelet sets it
        subprocess.run(["sh", SERVE, *sidecar["args"]], env=env, check=True, timeout=30)
        with open(record) as f:
            return f.read().splitlines()


SETTINGS = SerializationSettings(
    image_config=ImageConfig(
        default_image=Image(name="default", fqn=IMAGES["default"].split(":")[0], tag="v1"),
        images=[
            Image(name=name, fqn=full.split(":")[0], tag=full.split(":")[1])
            for name, full in IMAGES.items()
        ],
    ),
    project="relax",
    domain="dev",
    version="v1",
)


def _dynamic_nodes(node, cfg: RunConfig, checkpoint: str, **more) -> dict[str, list]:
    """The nodes a @dynamic builds on a cluster (as pyflyte-execute compiles it), by task. A
    @dynamic compiles once per process (one pod runs one), so each call takes a fresh one."""
    fresh = dynamic(node.task_function)
    cfg_json = json.dumps(config_to_dict(cfg), sort_keys=True)
    ctx = FlyteContextManager.current_context().with_serialization_settings(SETTINGS)
    with FlyteContextManager.with_context(ctx) as ctx:
        state = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(state)) as ctx:
            inputs = {"cfg_json": cfg_json, "checkpoint": checkpoint, **more}
            spec = fresh.dispatch_execute(ctx, TypeEngine.dict_to_literal_map(ctx, inputs))
    nodes: dict[str, list] = {}
    for node in spec.nodes:
        nodes.setdefault(node.metadata.name, []).append(node)
    return nodes


def _override_gpus(node) -> int:
    res = node.task_node.overrides.resources
    gpu = TaskResources.ResourceName.GPU
    requests = [r.value for r in res.requests if r.name == gpu]
    assert requests == [r.value for r in res.limits if r.name == gpu]
    return int(requests[0]) if requests else 0


def _at_step(tmp_path, version: int) -> str:
    """A checkpoint directory at policy version `version` (what rl_run reads)."""
    (tmp_path / "state.json").write_text(json.dumps({"policy_version": version, "run_id": "r"}))
    return str(tmp_path)


def test_rl_run_gives_each_role_the_run_s_own_resources(tmp_path):
    # Whatever config the workflows were registered with, the run's config decides.
    nodes = _dynamic_nodes(rl_run, _cfg("qwen3-30b-a3b-moe-r3"), _at_step(tmp_path, 0))
    (trainer,) = nodes["trainer_service"]
    o = trainer.task_node.overrides
    assert _override_gpus(trainer) == 8 and o.extended_resources.gpu_accelerator.device == (
        "nvidia-h100"
    )
    assert o.container_image == IMAGES["trainer"]
    assert _shm(o.pod_template.pod_spec)
    assert "RELAX_SGLANG_API_KEY" in _env(o.pod_template.pod_spec["containers"][0])
    assert len(nodes["sglang_rollout_service"]) == 2  # services.rollout_workers
    for rollout in nodes["sglang_rollout_service"]:
        spec = rollout.task_node.overrides.pod_template.pod_spec
        sidecar = next(c for c in spec["containers"] if c["name"] == "sglang")
        assert sidecar["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert sidecar["image"] == IMAGES["rollout"]
        assert sidecar["args"][:2] == ["--tp-size", "4"]
        assert "--enable-return-routed-experts" in sidecar["args"]
    (advantages,) = nodes["advantages_service"]
    assert _override_gpus(advantages) == 0


@pytest.mark.parametrize(
    ("name", "gpus", "image"),
    [("qwen3-4b-8xgpu-colocate", 8, IMAGES["trainer"]), ("cpu-default", 0, None)],
)
def test_rl_segment_gives_its_steps_the_run_s_own_resources(tmp_path, name, gpus, image):
    (steps,) = _dynamic_nodes(rl_segment, _cfg(name), _at_step(tmp_path, 0), nodes=1)["rl_steps"]
    o = steps.task_node.overrides
    # Colocate on SGLang: one server over 8 GPUs (--dp-size 8) takes turns with the trainer.
    assert _override_gpus(steps) == gpus
    assert o.container_image == image
    assert (o.extended_resources is not None) == bool(gpus)
    assert _shm(o.pod_template.pod_spec) == bool(gpus)
    # The run's own retries, spot capacity and timeout (pending + start-up + its steps).
    assert steps.metadata.retries.retries == 3 and steps.metadata.interruptible
    assert steps.metadata.timeout == timedelta(seconds=asks.timeout_s(_cfg(name), "rl_steps"))
    # Kubernetes' SIGTERM leaves the step under way time to end and be checkpointed.
    grace = _cfg(name).services.preemption_grace_s
    assert o.pod_template.pod_spec["terminationGracePeriodSeconds"] == grace


def test_overrides_are_empty_when_a_dynamic_runs_locally():
    assert resources.node_overrides(_cfg("qwen3-4b-8xgpu"), rl_steps) == {}


def test_the_accelerators_a_config_may_name_are_flytekit_s_nvidia_gpus():
    named = {
        v.to_flyte_idl().device
        for v in vars(accelerators).values()
        if isinstance(v, accelerators.BaseAccelerator)
    }
    assert set(ACCELERATORS) == {d for d in named if d.startswith("nvidia-")}


def test_shipped_configs_name_an_accelerator_exactly_when_they_need_gpus():
    for path in sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml"))):
        cfg = load_config(path)
        gpu_only = (
            cfg.rollout.engine == "sglang"
            or cfg.train.backend in ("fsdp", "megatron")
            or cfg.services.sync_backend == "nccl"
            # a vLLM server spread over several devices: tensor parallel over GPUs
            or (cfg.rollout.engine == "vllm" and "--tensor-parallel-size" in cfg.vllm.extra_args)
        )
        assert bool(cfg.services.accelerator) == gpu_only, path


def test_the_sglang_server_gpus_count_its_data_parallel_replicas():
    cfg = _cfg("qwen3-4b-8xgpu")
    assert placement.sglang_gpus(cfg) == 1
    tp = replace(cfg, services={"rollout_gpus": 2})
    assert placement.sglang_gpus(tp) == 2
    assert resources.gpus(tp, "sglang_rollout_service") == 2
    # Data-parallel replicas: colocate only (async refuses them, SGLang syncs no weights there)
    colocate = _cfg("qwen3-4b-8xgpu-colocate")
    assert placement.sglang_gpus(colocate) == 8
    wide = replace(colocate, services={"rollout_gpus": 2}, sglang={"extra_args": "--dp-size=4"})
    assert placement.sglang_gpus(wide) == 8
    assert placement.data_parallel("--log-level warning --data-parallel-size 3") == 3
    with pytest.raises(ValueError, match="sglang.extra_args: --dp-size needs a count"):
        placement.data_parallel("--dp-size many")


def test_a_registration_config_that_does_not_exist_is_named(monkeypatch):
    monkeypatch.setenv(resources.CONFIG_ENV, "configs/nope.yaml")
    with pytest.raises(FileNotFoundError, match="RELAX_CONFIG=configs/nope.yaml: no such file"):
        resources.registration_config.__wrapped__()
    monkeypatch.delenv(resources.CONFIG_ENV)
    assert resources.registration_config.__wrapped__() == RunConfig()


@pytest.mark.parametrize(("total", "per_node"), [(2000, 25), (1_000_000, 1)])
def test_the_loop_is_three_levels_deep_whatever_the_run_s_length(tmp_path, total, per_node):
    # rl_run -> rl_segment -> rl_steps: no level is added per node, so flytekit's local sandbox
    # paths and a cluster's storage keys do not grow with the run; no @dynamic holds more than
    # about sqrt(nodes) nodes.
    cfg = replace(_cfg("cpu-default"), train={"total_steps": total, "steps_per_node": per_node})
    nodes = -(-total // per_node)
    width = -(-int(nodes**0.5) // 1) + 1
    segments = _dynamic_nodes(rl_run, cfg, _at_step(tmp_path, 0))
    assert set(segments) == {"rl_segment"}
    sizes = [_literal_int(n, "nodes") for n in segments["rl_segment"]]
    assert sum(sizes) == nodes and max(sizes) <= width and len(sizes) <= width
    if total == 2000:  # the 80 nodes of a 2,000-step run at 25 steps per node
        assert sizes == [9] * 8 + [8]
    # Each segment's nodes are rl_steps tasks, and nothing under them is dynamic.
    steps = _dynamic_nodes(rl_segment, cfg, _at_step(tmp_path, 0), nodes=sizes[0])
    assert set(steps) == {"rl_steps"} and len(steps["rl_steps"]) == sizes[0]
    # A segment's deadline covers its nodes one after another, each with its own pending time.
    seg = segments["rl_segment"][0].metadata.timeout
    assert seg == timedelta(seconds=sizes[0] * asks.timeout_s(cfg, "rl_steps"))


def test_a_resumed_run_builds_only_the_steps_it_has_left(tmp_path):
    cfg = replace(_cfg("cpu-default"), train={"total_steps": 2000, "steps_per_node": 25})
    (segment,) = _dynamic_nodes(rl_run, cfg, _at_step(tmp_path, 1990))["rl_segment"]
    assert _literal_int(segment, "nodes") == 1
    # An async run's roles get the deadline of the steps left, not of the whole run.
    async_cfg = replace(cfg, mode="async", services={"launch": "tasks"})
    (trainer,) = _dynamic_nodes(rl_run, async_cfg, _at_step(tmp_path, 1990))["trainer_service"]
    assert trainer.metadata.timeout == timedelta(seconds=asks.budget_s(cfg, 10))


def _literal_int(node, name: str) -> int:
    (binding,) = (b for b in node.inputs if b.var == name)
    return binding.binding.scalar.primitive.integer
