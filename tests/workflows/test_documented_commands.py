"""The cluster commands of docs/cluster.md and README, run offline exactly as written: the plan
against the limits the docs tell the operator to set, the package with the images and code the
cluster will run, and the register and run commands using the same ones. What the package holds
is read back: image, resources, timeout and retries of every task and @dynamic node, and the
nightly launch plan's baked config."""

from __future__ import annotations

import shlex
from datetime import timedelta

import msgpack
from flytekit.clis.sdk_in_container.register import register
from flytekit.clis.sdk_in_container.run import run
from flytekit.models.task import Resources as TaskResources

from relax_core.config import load_config
from relax_core.ops import asks
from tests.workflows.conftest import (
    IMAGES,
    README,
    cluster_config,
    documented,
    fill,
    run_documented,
    shell_commands,
)

NAMES = {v: k.lower() for k, v in vars(TaskResources.ResourceName).items() if isinstance(v, int)}


def _primary(t) -> tuple[str, dict, dict, list[str]]:
    """(image, requests, limits, args) of a task's container, or its pod's primary container."""
    if t.k8s_pod is not None:
        (c,) = [c for c in t.k8s_pod.pod_spec["containers"] if c["name"] == "primary"]
        res = c.get("resources") or {}
        return c["image"], res.get("requests") or {}, res.get("limits") or {}, c["args"]
    res = t.container.resources
    requests = {NAMES[r.name]: r.value for r in res.requests}
    limits = {NAMES[r.name]: r.value for r in res.limits}
    return t.container.image, requests, limits, list(t.container.args)


def _flags(command: str) -> tuple[dict[str, str], list[str], list[str]]:
    """(leading environment, pyflyte's words, the subcommand's words) of a documented command."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[0] == "pyflyte", command
    sub = next(i for i, w in enumerate(words) if w in ("package", "register", "run"))
    return env, words[1:sub], words[sub + 1 :]


def _images(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a in ("--image", "-i")]


def test_readme_gives_the_commands_of_the_docs():
    docs = documented()
    readme = shell_commands(README, "## Run on a Flyte cluster")
    assert readme == [docs["plan"], docs["register"], docs["run"]]


def test_register_and_run_use_the_images_and_code_that_were_packaged():
    docs = documented()
    env, _, package = _flags(docs["package"])
    images = _images(package)
    assert images == [
        "<registry>/relax:v1",
        "trainer=<registry>/relax-trainer:v1",
        "rollout=<registry>/relax-rollout:v1",
    ]
    for kind in ("package", "register", "run"):
        env, top, args = _flags(docs[kind])
        assert env == {"RELAX_CONFIG": "my-cluster.yaml"}, kind
        assert _images(args) == images, kind
        assert args[args.index("--copy") + 1] == "all", kind  # not `auto`: lazy imports ship
    for kind in ("register", "run"):
        env, top, args = _flags(docs[kind])
        assert top == ["--config", "flyte.config"], kind
        assert args[args.index("-p") + 1] == "relax" and args[args.index("-d") + 1] == "development"
    _, _, run_args = _flags(docs["run"])
    assert run_args[-4:] == ["workflows/train.py", "train", "--cfg", "my-cluster.yaml"]
    # Both parse with pyflyte's own options (nothing is invoked).
    _, _, register_args = _flags(fill(docs["register"], "c.yaml"))
    ctx = register.make_context("register", register_args)
    assert ctx.params["copy"].name == "ALL" and ctx.params["project"] == "relax"
    assert list(ctx.params["image_config"].images) and ctx.params["version"] == "v1"
    run.make_context("run", shlex.split(fill(docs["run"], "c.yaml"))[4:])


def test_the_documented_plan_is_clean_for_a_cluster_config(tmp_path):
    config = cluster_config(tmp_path, "cpu-default")
    proc = run_documented(documented()["plan"], config)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "Flyte: every task registers and runs within the cluster's limits" in out
    assert "loop: 4 rl_steps nodes of 100 steps in 2 rl_segment nodes of at most 2" in out


def test_the_package_holds_every_task_as_the_config_asks(packaged, tmp_path):
    cfg = load_config(cluster_config(tmp_path, "cpu-default"))
    tasks = packaged["cpu-default"]
    for name in (*asks.TASKS, *asks.DYNAMICS):
        t, ask = tasks[name], asks.registered_ask(cfg, name)
        image, requests, limits, _ = _primary(t)
        assert image == IMAGES["default"], name
        assert t.metadata.retries.retries == ask.retries, name
        assert bool(t.metadata.interruptible) == ask.interruptible, name
        expected = timedelta(seconds=ask.timeout_s) if ask.timeout_s else None
        assert (t.metadata.timeout or None) == expected, name
        assert requests["cpu"] == str(ask.cpu) and limits["cpu"] == str(ask.cpu_limit), name
        assert requests["memory"] == f"{ask.memory_gib}Gi", name
        assert limits["memory"] == f"{ask.memory_limit_gib}Gi", name
    # The code ships with the package (--copy all): the tasks run pyflyte-fast-execute on it.
    args = _primary(tasks["rl_steps"])[3]
    assert args[0] == "pyflyte-fast-execute" and args[args.index("--additional-distribution") + 1]
    # rl_run holds the whole run; rl_segment gets its deadline from rl_run at run time.
    assert tasks["rl_run"].metadata.timeout == timedelta(seconds=asks.timeout_s(cfg, "rl_run"))


def test_the_nightly_launch_plan_bakes_the_cluster_config(packaged):
    lp = packaged["cpu-default"]["launch_plans"]["nightly_grpo"]
    assert lp.entity_metadata.schedule.cron_schedule.schedule == "0 2 * * *"
    binary = lp.default_inputs.parameters["cfg"].default.scalar.binary
    values = msgpack.unpackb(binary.value)
    assert values["storage"]["root"] == "s3://my-bucket/relax"
    assert values["tracking"]["tracking_uri"] == "http://mlflow.example:5000"
    assert values["tracking"]["experiment"] == "relax-nightly"
    assert values["model"]["source"] == "models:/relax-cpu-default/latest"
