"""The run config's Flyte type, built once per process.

flytekit's dataclass transformer builds a dataclass's literal type (its fields' types and the
JSON schema the Flyte console draws the input form from) again for every task and workflow
interface that names it, and for every nested section inside it. For `RunConfig` that is a whole
schema tree per interface (0.6 s each on 2 idle CPU cores), paid by every `pyflyte run` and every pod
that loads the workflow module before its task starts. This transformer is flytekit's own, with
the literal type of `RunConfig` kept after the first build: the same type, schema and values.
"""

from __future__ import annotations

from typing import Any

from flytekit.core.type_engine import DataclassTransformer, TypeEngine
from flytekit.models.types import LiteralType

from relax_core.config import RunConfig


class OnceDataclassTransformer(DataclassTransformer):
    """flytekit's dataclass transformer with each type's literal type built once."""

    def __init__(self) -> None:
        super().__init__()
        self._literal_types: dict[Any, LiteralType] = {}

    def get_literal_type(self, t: Any) -> LiteralType:
        found = self._literal_types.get(t)
        if found is None:
            found = self._literal_types[t] = super().get_literal_type(t)
        return found


def register_run_config() -> None:
    """Route `RunConfig` through OnceDataclassTransformer (a no-op when it already is)."""
    if not isinstance(TypeEngine.get_transformer(RunConfig), OnceDataclassTransformer):
        TypeEngine.register_additional_type(OnceDataclassTransformer(), RunConfig, override=True)
