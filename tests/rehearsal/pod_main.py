"""What runs inside a rehearsal pod, in the role of Flyte's `pyflyte-execute`.

    python -m tests.rehearsal.pod_main task tasks.rl.rl_steps '{"cfg_json": "...", ...}'
    python -m tests.rehearsal.pod_main call tests.rehearsal.probes:write_local '{...}'

`task` imports the Flyte entity by its name (module + attribute) and runs it:
- a plain task: `entity.task_function(**inputs)`, inputs typed as its interface says (a dataclass
  input such as RunConfig arrives as a mapping and is rebuilt with its `from_json`);
- a @dynamic: its function body runs for real (it may read storage to decide), but every Flyte
  entity it calls is replaced by a recorder, so what comes out is the graph it builds: the calls
  in order, each input a value or another call's output, and the dynamic's own output.

`call` runs a plain function of the test suite (probes, the queue audit) the same way.
The last line of stdout is MARKER followed by the result as JSON: a task's outputs keyed by its
Flyte output names (a NamedTuple's fields, else `o0`), or {"plan": ...} for a dynamic.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import os
import sys
import time
import typing
from typing import Any

MARKER = "REHEARSAL-OUTPUT "
_T0 = time.monotonic()


def resolve(name: str) -> Any:
    """`a.b.c` (module a.b, attribute c) or `a.b:c`."""
    module, _, attr = name.rpartition(":") if ":" in name else name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def to_json_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: to_json_value(v) for k, v in value._asdict().items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return to_json_value(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): to_json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_json_value(v) for v in value]
    raise TypeError(f"cannot hand on a {type(value).__name__} between pods: {value!r}")


def _typed(value: Any, tp: Any) -> Any:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(value, dict):
        if hasattr(tp, "from_json"):
            return tp.from_json(json.dumps(value))
        return tp(**value)
    return value


def _check_inputs(name: str, expected: dict[str, Any], given: dict[str, Any]) -> None:
    if set(expected) != set(given):
        raise TypeError(
            f"{name} takes inputs {sorted(expected)}, the rehearsal passed {sorted(given)}: the "
            "workflow and tests/rehearsal disagree"
        )


def outputs_of(entity: Any, result: Any) -> dict[str, Any]:
    """A task's result keyed by its Flyte output names."""
    names = list(entity.python_interface.outputs)
    if not names:
        return {}
    if len(names) == 1:
        return {names[0]: to_json_value(result)}
    return {n: to_json_value(getattr(result, n)) for n in names}


def run_task(name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    from flytekit.core.python_function_task import PythonFunctionTask

    entity = resolve(name)
    _note("imported")
    interface = entity.python_interface.inputs
    _check_inputs(name, interface, inputs)
    hints = typing.get_type_hints(entity.task_function)
    kwargs = {k: _typed(v, hints.get(k, interface[k])) for k, v in inputs.items()}
    if getattr(entity, "execution_mode", None) == PythonFunctionTask.ExecutionBehavior.DYNAMIC:
        return {"plan": record_plan(entity, kwargs)}
    return outputs_of(entity, entity.task_function(**kwargs))


# --------------------------------------------------------------------------- dynamic plans


class Ref:
    """A recorded call's output, as a Promise stands for a node's output in a dynamic."""

    def __init__(self, call: int, var: str | None = None) -> None:
        self.call, self.var = call, var

    def __getattr__(self, var: str) -> Ref:
        if var.startswith("_"):
            raise AttributeError(var)
        return Ref(self.call, var)

    def with_overrides(self, **overrides: Any) -> Ref:
        return self


class Recorder:
    def __init__(self, entity: Any, calls: list[dict[str, Any]]) -> None:
        self.entity, self.calls = entity, calls

    def __getattr__(self, attr: str) -> Any:  # name, python_interface, ... of the entity
        return getattr(self.entity, attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Ref:
        if args:
            raise TypeError(f"{self.entity.name}: Flyte entities take keyword arguments only")
        self.calls.append({"task": self.entity.name, "inputs": dict(kwargs)})
        return Ref(len(self.calls) - 1)


def _encode(value: Any) -> Any:
    if isinstance(value, Ref):
        return {"$ref": [value.call, value.var]}
    return {"$value": to_json_value(value)}


def record_plan(dynamic: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Run a dynamic's body with every Flyte entity of tasks.* and workflows.* replaced."""
    from flytekit.core.base_task import PythonTask
    from flytekit.core.workflow import WorkflowBase

    calls: list[dict[str, Any]] = []
    patched: list[tuple[dict, str, Any]] = []
    for mod_name, module in list(sys.modules.items()):
        if mod_name.split(".")[0] not in ("tasks", "workflows") or module is None:
            continue
        namespace = vars(module)
        for attr, value in list(namespace.items()):
            if isinstance(value, (PythonTask, WorkflowBase)):
                patched.append((namespace, attr, value))
                namespace[attr] = Recorder(value, calls)
    try:
        result = dynamic.task_function(**kwargs)
    finally:
        for namespace, attr, value in patched:
            namespace[attr] = value
    return {
        "calls": [
            {"task": c["task"], "inputs": {k: _encode(v) for k, v in c["inputs"].items()}}
            for c in calls
        ],
        "output": _encode(result),
    }


def _note(text: str) -> None:
    print(f"[pod_main +{time.monotonic() - _T0:.1f}s] {text}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("task", "call"):
        print(__doc__, file=sys.stderr)
        return 2
    mode, name, raw = argv
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    _note(f"{mode} {name} in pod {os.environ.get('RELAX_POD_NAME', '?')}")
    if not raw.lstrip().startswith("{"):
        with open(raw) as f:
            raw = f.read()
    inputs = json.loads(raw)
    if mode == "task":
        result = run_task(name, inputs)
    else:
        result = {"o0": to_json_value(resolve(name)(**inputs))}
    _note("done")
    print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
