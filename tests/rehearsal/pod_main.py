"""What runs inside a rehearsal pod, in the role of Flyte's `pyflyte-execute`.

    python -m tests.rehearsal.pod_main task tasks.rl.rl_steps '{"cfg_json": "...", ...}'
    python -m tests.rehearsal.pod_main call tests.rehearsal.probes:write_local '{...}'

`task` imports the Flyte entity by its name (module + attribute) and runs it:
- a plain task: `entity.task_function(**inputs)`, inputs typed as its interface says (a dataclass
  input such as RunConfig arrives as a mapping and is rebuilt with its `from_json`);
- a @dynamic: compiled as on a cluster (record_plan): its body runs for real (it may read
  storage to decide) and what comes out is the DynamicJobSpec propeller would be handed: the
  nodes it starts with their inputs, overrides (resources, timeout, retries) and task templates,
  and the dynamic's own output.

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


def record_plan(dynamic: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Compile a dynamic's body as pyflyte-execute does on a cluster (flytekit's
    `compile_into_workflow`: the body runs for real, each call it makes becomes a node with the
    overrides it was given) and return what propeller is handed, as JSON: {"job": a
    DynamicJobSpec (nodes, their task templates, the outputs)}, or {"outputs": a LiteralMap}
    when the body started no node."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.models.dynamic_job import DynamicJobSpec
    from google.protobuf.json_format import MessageToDict

    from tests.rehearsal.flyte_rules import serialization_settings

    ctx = FlyteContextManager.current_context().with_serialization_settings(
        serialization_settings()
    )
    with FlyteContextManager.with_context(ctx) as ctx:
        compiled = dynamic.compile_into_workflow(ctx, dynamic.task_function, **kwargs)
    key = "job" if isinstance(compiled, DynamicJobSpec) else "outputs"
    return {key: MessageToDict(compiled.to_flyte_idl())}


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
