"""Walking a Flyte workflow's compiled graph in the order a Flyte cluster runs it.

`walk_workflow(wf, inputs, run_entity)` reads the nodes flytekit compiled from the workflow
function (the same graph `pyflyte register` serializes), resolves each node's input bindings
from the workflow inputs and earlier node outputs (attribute paths included), evaluates branch
conditions (`conditional(...)`) and calls `run_entity(entity, inputs)` for each task or dynamic
node, which returns that node's outputs keyed by output name. So the rehearsal follows
workflows/train.py as it is, not a copy of it.

A @dynamic's plan (`pod_main.record_plan`) is the DynamicJobSpec flytekit compiled, as JSON;
`decode_plan` reads it back into flytekit's models, whose nodes bind their inputs the same way
(node ids "dn0", "dn1", ...), so `bindings` and `outputs_of_plan` resolve them too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flytekit.core.condition import BranchNode
from flytekit.core.workflow import WorkflowBase
from flytekit.models.core.condition import ComparisonExpression, ConjunctionExpression

Outputs = dict[str, Any]
RunEntity = Callable[[Any, dict[str, Any], Any], Outputs]
"""run_entity(entity, inputs, node): `node` is the flytekit Node (its `metadata` holds the node's
timeout and retries)."""

_COMPARE = {
    ComparisonExpression.Operator.EQ: lambda a, b: a == b,
    ComparisonExpression.Operator.NEQ: lambda a, b: a != b,
    ComparisonExpression.Operator.GT: lambda a, b: a > b,
    ComparisonExpression.Operator.GTE: lambda a, b: a >= b,
    ComparisonExpression.Operator.LT: lambda a, b: a < b,
    ComparisonExpression.Operator.LTE: lambda a, b: a <= b,
}


class GraphError(RuntimeError):
    """The workflow uses something the rehearsal cannot walk; the message says what."""


def single_output(outputs: Outputs, what: str) -> Any:
    if len(outputs) != 1:
        raise GraphError(f"{what} has outputs {sorted(outputs)}; expected exactly one")
    return next(iter(outputs.values()))


def _path(value: Any, attr_path: list, what: str) -> Any:
    for step in attr_path:
        indexable = isinstance(value, list) and isinstance(step, int)
        if indexable or (isinstance(value, dict) and step in value):
            value = value[step]
        else:
            raise GraphError(f"{what}: no {step!r} in {type(value).__name__}")
    return value


def _binding_value(data: Any, values: dict[str, Outputs], what: str) -> Any:
    if data.promise is not None:
        promise = data.promise
        node_outputs = values.get(promise.node_id)
        if node_outputs is None or promise.var not in node_outputs:
            raise GraphError(f"{what}: node {promise.node_id!r} has no output {promise.var!r}")
        return _path(node_outputs[promise.var], list(promise.attr_path or []), what)
    if data.scalar is not None and data.scalar.primitive is not None:
        return data.scalar.primitive.value
    if data.scalar is not None and data.scalar.none_type is not None:
        return None
    if data.collection is not None:
        return [_binding_value(b, values, what) for b in data.collection.bindings]
    if data.map is not None:
        return {k: _binding_value(b, values, what) for k, b in data.map.bindings.items()}
    raise GraphError(f"{what}: a binding the rehearsal cannot read: {data}")


def bindings(node: Any, values: dict[str, Outputs]) -> dict[str, Any]:
    """A node's inputs: a compiled Node's `bindings` or a serialized (model) Node's `inputs`."""
    given = node.bindings if hasattr(node, "bindings") else node.inputs
    return {b.var: _binding_value(b.binding, values, f"{node.id}.{b.var}") for b in given}


def _operand(operand: Any, scope: dict[str, Any]) -> Any:
    if operand.var:
        return scope[operand.var]
    if operand.primitive is not None:
        return operand.primitive.value
    raise GraphError(f"a condition operand the rehearsal cannot read: {operand}")


def _holds(expr: Any, scope: dict[str, Any]) -> bool:
    if expr.comparison is not None:
        c = expr.comparison
        return _COMPARE[c.operator](_operand(c.left_value, scope), _operand(c.right_value, scope))
    j = expr.conjunction
    left, right = _holds(j.left_expression, scope), _holds(j.right_expression, scope)
    if j.operator == ConjunctionExpression.LogicalOperator.AND:
        return left and right
    return left or right


def choose_branch(branch: BranchNode, scope: dict[str, Any]) -> Any:
    """The node a `conditional` runs, given its condition inputs by name."""
    block = branch._ifelse_block
    for case in [block.case, *(block.other or [])]:
        if _holds(case.condition, scope):
            return case.then_node
    if block.else_node is not None:
        return block.else_node
    raise GraphError(f"conditional {branch.name!r}: no case holds and it has no else: {scope}")


def walk_workflow(wf: WorkflowBase, inputs: dict[str, Any], run_entity: RunEntity) -> Outputs:
    """Run `wf`'s nodes one after another (its node order is a topological order)."""
    values: dict[str, Outputs] = {"": dict(inputs)}  # "" is flytekit's GLOBAL_INPUT_NODE_ID
    for node in wf.nodes:
        entity = node.flyte_entity
        if isinstance(entity, BranchNode):
            chosen = choose_branch(entity, bindings(node, values))
            values[node.id] = run_node(chosen, values, run_entity)
        else:
            values[node.id] = run_node(node, values, run_entity)
    return {b.var: _binding_value(b.binding, values, f"output {b.var}") for b in wf.output_bindings}


def run_node(node: Any, values: dict[str, Outputs], run_entity: RunEntity) -> Outputs:
    entity = node.flyte_entity
    if isinstance(entity, WorkflowBase):
        return walk_workflow(entity, bindings(node, values), run_entity)
    if not hasattr(entity, "task_function"):
        raise GraphError(f"node {node.id}: {type(entity).__name__} is not a task the pods run")
    return run_entity(entity, bindings(node, values), node)


def decode_plan(plan: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(the DynamicJobSpec as a flytekit model and as its flyteidl message, or None and None
    when the dynamic started no node; the dynamic's outputs by name when it started none)."""
    from flyteidl.core import dynamic_job_pb2, literals_pb2
    from flytekit.models.dynamic_job import DynamicJobSpec
    from flytekit.models.literals import LiteralMap
    from google.protobuf.json_format import ParseDict

    if "job" in plan:
        message = ParseDict(plan["job"], dynamic_job_pb2.DynamicJobSpec())
        return DynamicJobSpec.from_flyte_idl(message), message, {}
    literals = LiteralMap.from_flyte_idl(ParseDict(plan["outputs"], literals_pb2.LiteralMap()))
    return None, None, {k: literal_value(v, f"output {k}") for k, v in literals.literals.items()}


def literal_value(literal: Any, what: str) -> Any:
    if literal.scalar is not None and literal.scalar.primitive is not None:
        return literal.scalar.primitive.value
    if literal.scalar is not None and literal.scalar.none_type is not None:
        return None
    raise GraphError(f"{what}: a literal the rehearsal cannot read: {literal}")


def upstream(node: Any) -> set[str]:
    """The node ids a serialized node's inputs wait for."""
    return set(node.upstream_node_ids or ()) | {
        b.binding.promise.node_id for b in node.inputs if b.binding.promise is not None
    }


def outputs_of_plan(job: Any, values: dict[str, Outputs]) -> Outputs:
    return {b.var: _binding_value(b.binding, values, f"output {b.var}") for b in job.outputs}
