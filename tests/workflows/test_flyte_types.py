"""The run config's Flyte type: built once, and exactly what flytekit's own transformer gives."""

from __future__ import annotations

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
