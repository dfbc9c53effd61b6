"""Walking a Flyte workflow's compiled graph in the order a Flyte cluster runs it.

`walk_workflow(wf, inputs, run_entity)` reads the nodes flytekit compiled from the workflow
function (the same graph `pyflyte register` serializes), resolves each node's input bindings
from the workflow inputs and earlier node outputs (attribute paths included), evaluates branch
conditions (`conditional(...)`) and calls `run_entity(entity, inputs)` for each task or dynamic
node, which returns that node's outputs keyed by output name. So the rehearsal follows
workflows/train.py as it is, not a copy of it.

Dynamic plans (`pod_main.record_plan`) are values in the same shape: each call's inputs are
{"$value": v} or {"$ref": [call, output name or None]}; `plan_value` resolves one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flytekit.core.condition import BranchNode
from flytekit.core.workflow import WorkflowBase
from flytekit.models.core.condition import ComparisonExpression, ConjunctionExpression

Outputs = dict[str, Any]
RunEntity = Callable[[Any, dict[str, Any]], Outputs]

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
    return {b.var: _binding_value(b.binding, values, f"{node.id}.{b.var}") for b in node.bindings}


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
    return run_entity(entity, bindings(node, values))


def plan_value(encoded: dict[str, Any], results: list[Outputs | None]) -> Any:
    """A dynamic plan's value: a literal, or a call's (named or only) output."""
    if "$value" in encoded:
        return encoded["$value"]
    call, var = encoded["$ref"]
    outputs = results[call]
    if outputs is None:
        raise GraphError(f"plan call {call} has not finished")
    return outputs[var] if var else single_output(outputs, f"plan call {call}")


def plan_refs(encoded_inputs: dict[str, Any]) -> set[int]:
    """The calls a plan call's inputs wait for."""
    return {v["$ref"][0] for v in encoded_inputs.values() if "$ref" in v}
