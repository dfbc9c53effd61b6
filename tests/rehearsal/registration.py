"""The workflows registered as a cluster's operator registers them, offline.

    package = register(cfg_dict, workdir)   # RELAX_CONFIG=<cfg> pyflyte --pkgs workflows package
    package.check(RECOMMENDED)              # RegistrationRefused: what flyteadmin would refuse
    package.node_metadata("workflows.train.train")          # the registered nodes' timeouts
    package.default_input("nightly_grpo", "cfg", RunConfig)  # a launch plan's baked input

`register` serializes in a process of its own, since the tasks take their asks from
$RELAX_CONFIG when tasks/rl.py is imported, with flytekit's own `serialize_to_folder` (what
`pyflyte package` runs before it tars the folder), and reads the .pb files back into flytekit's
models. The rules applied to them are flyte_rules.py's.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import TypeEngine
from flytekit.models.admin.workflow import WorkflowSpec
from flytekit.models.launch_plan import LaunchPlan
from flytekit.models.task import TaskSpec

from relax_core.ops.flyte_plan import Limits
from tests.rehearsal.flyte_rules import (
    RegistrationRefused,
    registration_problems,
    serialization_settings,
)

REPO = str(Path(__file__).resolve().parents[2])
CONFIG_ENV = "RELAX_CONFIG"
"""tasks/resources.py: the run config the tasks are registered with."""
PACKAGES = ("workflows",)
"""What `pyflyte --pkgs workflows package` loads (docs/cluster.md); tasks/ comes with it."""


@dataclass
class Package:
    """What `pyflyte package` wrote, read back: task templates, workflow specs and launch plans
    (flytekit models), keyed by name."""

    tasks: dict[str, Any]
    workflows: dict[str, Any]
    launch_plans: dict[str, Any]

    def problems(self, limits: Limits) -> list[str]:
        return registration_problems(self.tasks.values(), limits)

    def check(self, limits: Limits) -> None:
        problems = self.problems(limits)
        if problems:
            raise RegistrationRefused(
                f"flyteadmin would refuse to register {len(problems)} task resource(s) on a "
                f"cluster with {limits.describe()}:\n  - " + "\n  - ".join(problems)
            )

    def node_metadata(self, workflow: str) -> dict[str, Any]:
        """node id -> NodeMetadata (timeout, retries) of a registered workflow's nodes."""
        spec = self.workflows.get(workflow)
        return {n.id: n.metadata for n in spec.template.nodes} if spec is not None else {}

    def default_input(self, launch_plan: str, name: str, python_type: type) -> Any:
        return default_input(self.launch_plans[launch_plan], name, python_type)


def default_input(launch_plan: Any, name: str, python_type: type) -> Any:
    """A serialized launch plan's default input, decoded as the task that receives it would."""

    parameter = launch_plan.spec.default_inputs.parameters[name]
    ctx = FlyteContextManager.current_context()
    return TypeEngine.to_python_value(ctx, parameter.default, python_type)


def read_package(folder: str | os.PathLike) -> Package:
    """The .pb files `pyflyte package` writes: `<n>_<name>_<kind>.pb`, kind 1 a task, 2 a
    workflow, 3 a launch plan."""
    kinds = {
        "1": (task_pb2.TaskSpec, lambda m: TaskSpec.from_flyte_idl(m).template),
        "2": (workflow_pb2.WorkflowSpec, WorkflowSpec.from_flyte_idl),
        "3": (launch_plan_pb2.LaunchPlan, LaunchPlan.from_flyte_idl),
    }
    found: dict[str, dict[str, Any]] = {"1": {}, "2": {}, "3": {}}
    for path in sorted(glob.glob(os.path.join(folder, "*.pb"))):
        kind = path.rsplit("_", 1)[-1].removesuffix(".pb")
        message, convert = kinds[kind]
        proto = message()
        with open(path, "rb") as f:
            proto.ParseFromString(f.read())
        model = convert(proto)
        name = model.id.name if kind != "2" else model.template.id.name
        found[kind][name] = model
    return Package(found["1"], found["2"], found["3"])


def register(cfg: dict[str, Any] | None, workdir: str | os.PathLike) -> Package:
    """Serialize every task, workflow and launch plan as `RELAX_CONFIG=<cfg> pyflyte --pkgs
    workflows package` would (cfg None: RELAX_CONFIG unset), in a process of its own, and read
    them back. ~4 s of CPU: the process imports the workflows."""

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    if cfg is not None:
        path = workdir / "registration.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        env[CONFIG_ENV] = str(path)
    out = workdir / "package"
    done = subprocess.run(
        [sys.executable, "-m", "tests.rehearsal.registration", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"serializing the workflows (RELAX_CONFIG={env.get(CONFIG_ENV, '')!r}) failed:\n"
            + (done.stderr or done.stdout)[-4000:]
        )
    return read_package(out)


def _serialize(folder: str) -> None:
    """What `pyflyte --pkgs workflows package` does before it tars the folder."""
    from flytekit.tools.repo import serialize_to_folder

    os.makedirs(folder, exist_ok=True)
    serialize_to_folder(list(PACKAGES), serialization_settings(), REPO, folder)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.rehearsal.registration <output folder>", file=sys.stderr)
        return 2
    _serialize(argv[0])
    print(json.dumps({"folder": argv[0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
