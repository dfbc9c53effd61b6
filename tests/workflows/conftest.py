"""The cluster commands of docs/cluster.md and README, as a user runs them, offline.

`documented()` reads the `bash` blocks of "Register and run" in docs/cluster.md; `run_documented`
runs one of them exactly as written, with its placeholders filled: `my-cluster.yaml` (a config
written by the test), `<registry>` and `flyte-package.tgz`. The `packaged` fixture is the
documented `pyflyte package` command run for three configs side by side, read back task by task.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tarfile

import pytest
import yaml
from flyteidl.admin import launch_plan_pb2, task_pb2
from flytekit.models.launch_plan import LaunchPlanSpec
from flytekit.models.task import TaskSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLUSTER_DOC = os.path.join(REPO, "docs", "cluster.md")
README = os.path.join(REPO, "README.md")
REGISTRY = "ghcr.io/relax"
IMAGES = {
    "default": f"{REGISTRY}/relax:v1",
    "trainer": f"{REGISTRY}/relax-trainer:v1",
    "rollout": f"{REGISTRY}/relax-rollout:v1",
}
PACKAGED = ("cpu-default", "qwen3-4b-8xgpu", "qwen3-30b-a3b-moe-r3")
ON_CLUSTER = {
    "storage": {"root": "s3://my-bucket/relax"},
    "tracking": {"tracking_uri": "http://mlflow.example:5000"},
}


def shell_commands(path: str, section: str) -> list[str]:
    """The commands of the ```bash blocks under `section` (a heading) of `path`, continuation
    lines joined, comments and blank lines left out."""
    with open(path) as f:
        text = f.read()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    part = text[start : end if end > 0 else None]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", part, re.S):
        lines = [re.sub(r"^\s+", "", line) for line in block.splitlines()]
        joined = " ".join(
            line.removesuffix("\\").rstrip() if line.endswith("\\") else line + "\n"
            for line in lines
            if line and not line.startswith("#")
        )
        commands += [" ".join(c.split()) for c in joined.split("\n") if c.strip()]
    return commands


def documented(path: str = CLUSTER_DOC, section: str = "## Register and run") -> dict[str, str]:
    """plan, package, register and run: the one command of each kind in `section`."""
    kinds = {
        "plan": lambda c: c.startswith("relax plan "),
        "package": lambda c: " package " in c and "pyflyte" in c,
        "register": lambda c: " register " in c and "pyflyte" in c,
        "run": lambda c: " run --remote " in c,
    }
    commands = shell_commands(path, section)
    found = {}
    for kind, match in kinds.items():
        (found[kind],) = [c for c in commands if match(c)]
    return found


def cluster_config(directory, base: str, **more) -> str:
    """A shipped config plus where the run lives on a cluster, as README step 1 writes it."""
    with open(os.path.join(REPO, "configs", f"{base}.yaml")) as f:
        data = yaml.safe_load(f)
    for section, values in {**ON_CLUSTER, **more}.items():
        data.setdefault(section, {}).update(values)
    path = os.path.join(str(directory), "my-cluster.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(data, f)
    return path


def fill(command: str, config: str, package: str = "flyte-package.tgz") -> str:
    return (
        command.replace("my-cluster.yaml", config)
        .replace("<registry>", REGISTRY)
        .replace("-o flyte-package.tgz", f"-o {package}")
    )


def run_documented(command: str, config: str, package: str = "flyte-package.tgz"):
    """`command` as written, placeholders filled, in the repo with this environment's tools."""
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    return subprocess.Popen(
        ["bash", "-c", fill(command, config, package)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(scope="session")
def packaged(tmp_path_factory) -> dict[str, dict]:
    """config name -> {task name: TaskTemplate, "launch_plans": {name: LaunchPlanSpec}}: the
    documented package command for each config (on a cluster), all three side by side."""
    command = documented()["package"]
    procs = {}
    for name in PACKAGED:
        directory = tmp_path_factory.mktemp(name)
        config = cluster_config(directory, name)
        out = directory / "flyte-package.tgz"
        procs[name] = (out, run_documented(command, config, str(out)))
    tasks: dict[str, dict] = {}
    for name, (out, proc) in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-3000:]
        with tarfile.open(out) as tar:
            tar.extractall(out.parent, filter="data")
        tasks[name] = {"launch_plans": {}}
        # flytekit names each file <n>_<name>_<kind>.pb: 1 a task, 2 a workflow, 3 a launch plan
        for path in glob.glob(str(out.parent / "*_1.pb")):
            spec = task_pb2.TaskSpec()
            with open(path, "rb") as f:
                spec.ParseFromString(f.read())
            template = TaskSpec.from_flyte_idl(spec).template
            tasks[name][template.id.name.rsplit(".", 1)[1]] = template
        for path in glob.glob(str(out.parent / "*_3.pb")):
            lp = launch_plan_pb2.LaunchPlan()
            with open(path, "rb") as f:
                lp.ParseFromString(f.read())
            tasks[name]["launch_plans"][lp.id.name] = LaunchPlanSpec.from_flyte_idl(lp.spec)
    return tasks
