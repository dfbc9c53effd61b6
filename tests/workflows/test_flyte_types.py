"""The run config's Flyte type: built once, and exactly what flytekit's own transformer gives."""

from __future__ import annotations

import pytest
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.type_engine import DataclassTransformer, TypeEngine

from relax_core.config import RunConfig, load_config, replace
from tasks.flyte_types import OnceDataclassTransformer, register_run_config
from workflows.train import train


def test_run_config_literal_type_is_flytekits_and_built_once():
    register_run_config()
    register_run_config()  # idempotent: importing both task modules registers twice
    assert isinstance(TypeEngine.get_transformer(RunConfig), OnceDataclassTransformer)
    first = TypeEngine.to_literal_type(RunConfig)
    assert TypeEngine.to_literal_type(RunConfig) is first
    # The console's input form and the registered interface see flytekit's own type and schema.
    assert first == DataclassTransformer().get_literal_type(RunConfig)
    assert first.metadata["title"] == "RunConfig"
    assert train.python_interface.inputs["cfg"] is RunConfig
    assert train.interface.inputs["cfg"].type == first


def test_run_config_travels_through_flyte_unchanged():
    cfg = load_config("configs/cpu-default.yaml")
    cfg = replace(cfg, seed=7, train={"total_steps": 3})
    ctx = FlyteContextManager.current_context()
    literal = TypeEngine.to_literal(ctx, cfg, RunConfig, TypeEngine.to_literal_type(RunConfig))
    back = TypeEngine.to_python_value(ctx, literal, RunConfig)
    assert back == cfg
    assert back.train.total_steps == 3 and back.seed == 7


def test_the_built_type_is_kept_on_disk_for_the_next_process(tmp_path, monkeypatch):
    from flytekit.models.types import LiteralType, SimpleType

    from tasks.flyte_types import cache_dir, type_key

    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    built = OnceDataclassTransformer().get_literal_type(RunConfig)
    assert built == DataclassTransformer().get_literal_type(RunConfig)
    path = cache_dir() / f"{type_key(RunConfig)}.pb"
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left
    # A new process's transformer takes what is on disk (a marker type here proves it read it).
    marker = LiteralType(simple=SimpleType.STRING)
    path.write_bytes(marker.to_flyte_idl().SerializeToString())
    assert OnceDataclassTransformer().get_literal_type(RunConfig) == marker
    # Unreadable bytes are built again and replaced.
    path.write_bytes(b"\xff not a literal type")
    assert OnceDataclassTransformer().get_literal_type(RunConfig) == built
    assert OnceDataclassTransformer().get_literal_type(RunConfig) == built  # rewritten whole


def test_a_cache_that_cannot_be_written_costs_only_the_build(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("RELAX_CACHE_DIR", str(blocker))
    built = OnceDataclassTransformer().get_literal_type(RunConfig)
    assert built == DataclassTransformer().get_literal_type(RunConfig)


def test_the_summaries_tasks_return_are_flytekits_types_kept_on_disk(tmp_path, monkeypatch):
    from tasks.evaluate import EvalSummary
    from tasks.flyte_types import cache_dir, type_key
    from tasks.rl import RunSummary, finish_run
    from workflows.evaluate import evaluate

    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    for t in (RunSummary, EvalSummary):
        assert isinstance(TypeEngine.get_transformer(t), OnceDataclassTransformer)
        fresh = OnceDataclassTransformer((t,)).get_literal_type(t)
        assert fresh == DataclassTransformer().get_literal_type(t)
        assert (cache_dir() / f"{type_key(t)}.pb").is_file()
    assert finish_run.interface.outputs["o0"].type == DataclassTransformer().get_literal_type(
        RunSummary
    )
    assert train.interface.outputs["o0"].type == finish_run.interface.outputs["o0"].type
    assert evaluate.interface.outputs["o0"].type == DataclassTransformer().get_literal_type(
        EvalSummary
    )


def test_the_key_follows_the_source_of_the_module_defining_the_type(tmp_path, monkeypatch):
    import importlib
    import sys

    from tasks.flyte_types import type_key

    module = tmp_path / "summary_mod.py"
    source = "from dataclasses import dataclass\n\n@dataclass\nclass S:\n    a: int\n"
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    first = type_key(importlib.import_module("summary_mod").S)
    assert type_key(sys.modules["summary_mod"].S) == first  # stable in a process
    module.write_text(source + "    b: str = ''\n")
    del sys.modules["summary_mod"]
    try:
        assert type_key(importlib.import_module("summary_mod").S) != first
    finally:
        sys.modules.pop("summary_mod", None)  # the temporary module leaves with its directory


@pytest.mark.slow
def test_a_warm_cache_spares_a_process_mashumaros_schema_builder(tmp_path):
    """With every interface dataclass's type on disk, loading both workflows imports no JSON
    schema builder (0.25-0.33 s of every `pyflyte run` and task pod on 2 cores)."""
    import os
    import subprocess
    import sys

    probe = (
        "import sys, workflows.train, workflows.evaluate; "
        "print('mashumaro.jsonschema' in sys.modules)"
    )
    env = {**os.environ, "RELAX_CACHE_DIR": str(tmp_path)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    assert runs == ["True", "False"]  # the first process builds and keeps them; the next reads


def test_a_type_without_source_to_key_on_is_built_not_cached(tmp_path, monkeypatch):
    """A bytecode-only install has no source file to key the cache on: the type is built, as
    flytekit builds it, and nothing is written."""
    import tasks.flyte_types as flyte_types
    from tasks.rl import RunSummary

    monkeypatch.setenv("RELAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(flyte_types, "source_of", lambda _: None)
    built = OnceDataclassTransformer((RunSummary,)).get_literal_type(RunSummary)
    assert built == DataclassTransformer().get_literal_type(RunSummary)
    assert list(tmp_path.iterdir()) == []
