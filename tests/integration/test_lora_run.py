"""LoRA runs end to end: colocate and async (adapters over the gloo broadcast group) train the
same adapter at max_staleness 0, the base never moves, and each checkpoint is base + adapter; the
registered model is that pair; FSDP2 colocate scores its KL anchor with the adapters off. Each run
of the module runs once (module-scoped fixtures) in one directory, so they share the warm-started
policy, and tests read what each left. (A two-rank FSDP LoRA trainer is
tests/integration/test_multi_rank_trainer.py's; an async LoRA run at max_staleness 1 whose
engines sample with the adapter version they report, over the object store, is
tests/integration/test_omni_run.py's.)"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_core.models import lora
from relax_core.models.lora import ADAPTER_DIR
from relax_core.train.checkpoint import list_checkpoints, read_state
from tests.conftest import workdir_for
from tests.integration.test_async_run import ASYNC, _final, _metrics
from tests.runs import run_small

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # whole runs, each over 5 s

LORA = {
    "train": {"total_steps": 4, "checkpoint_every": 2, "lr": 5e-3, "lora": {"rank": 4}},
    # The entropy bonus gives every step a gradient; the KL term scores the base policy, the
    # LoRA policy with its adapters off (colocate) or the starting policy (async's reference).
    "algorithm": {"entropy_coef": 0.01, "kl_coef": 0.01},
}


@pytest.fixture(scope="module")
def module_workdir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Where every run of this module runs."""
    yield from workdir_for(tmp_path_factory, "lora")


def _adapter(ckpt: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(ckpt, ADAPTER_DIR, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def both_modes(module_workdir: Path) -> tuple[str, str]:
    """(colocate's, async's) final checkpoints of one LoRA run each at max_staleness 0; the
    colocate run registers its policy as `lora-policy`."""
    registered = {"tracking": {"registered_model": "lora-policy"}}
    run_small(module_workdir, "c.yaml", run_name="c", **LORA, **registered)
    run_small(module_workdir, "a.yaml", run_name="a", **LORA, **ASYNC)
    return _final(module_workdir, "c"), _final(module_workdir, "a")


def test_lora_trains_the_same_adapter_in_both_modes_on_a_frozen_base(module_workdir, both_modes):
    c_ckpt, a_ckpt = both_modes
    assert read_state(a_ckpt)["policy_version"] == 4
    first = min(list_checkpoints(os.path.dirname(c_ckpt)))
    start_base = load_file(os.path.join(first, "model.safetensors"))
    for ckpt in (c_ckpt, a_ckpt):
        base = load_file(os.path.join(ckpt, "model.safetensors"))
        assert base.keys() == start_base.keys()
        for name, tensor in base.items():
            assert torch.equal(tensor, start_base[name]), name  # the base never trains
        assert not os.path.exists(os.path.join(ckpt, "master.safetensors"))
    c_adapter, a_adapter = _adapter(c_ckpt), _adapter(a_ckpt)
    assert any(t.abs().sum() > 0 for n, t in c_adapter.items() if "lora_B" in n)  # it learned
    assert c_adapter.keys() == a_adapter.keys()
    for name, tensor in c_adapter.items():
        # Strict on-policy async: rollout sampled with every new adapter, as colocate did.
        torch.testing.assert_close(a_adapter[name], tensor, rtol=0, atol=1e-6)
    # Both KL anchors (colocate: the adapters off; async: the reference role's starting policy)
    # are the base: the policy equals it until the adapter first trains (B starts at zero).
    for ckpt in (c_ckpt, a_ckpt):
        kl = _metrics(module_workdir, read_state(ckpt)["tracking_run_id"], "train/kl")
        assert len(kl) == 4 and abs(kl[0]) < 1e-7 and kl[-1] > 1e-6, kl


def test_the_registered_lora_policy_is_the_final_base_and_adapter(module_workdir, both_modes):
    """The registered model is the final base + adapter pair: served as a pyfunc it holds the
    trained adapter, and evaluating it is evaluating the final checkpoint."""
    import mlflow

    from relax_core.config import load_config
    from relax_core.run.evaluate import evaluate_checkpoint
    from relax_core.run.session import RunSession

    ckpt = both_modes[0]
    adapter = _adapter(ckpt)
    cfg = load_config(str(module_workdir / "c.yaml"))
    # A colocate session's torch engine shares the trainer's frozen base, not a copy of it,
    # and holds adapters of its own, equal to the trainer's after a sync.
    session = RunSession.from_checkpoint(cfg, ckpt)
    engine, trainer = session.engine.model, session.model
    for (name, mine), theirs in zip(engine.named_parameters(), trainer.parameters(), strict=True):
        if ".lora_" in name:
            assert mine is not theirs and torch.equal(mine, theirs), name
        else:
            assert mine is theirs, name
    session.close()
    ev = evaluate_checkpoint(cfg, "", k=2, n_samples=2, model="models:/lora-policy/latest")
    assert ev["checkpoint"] == "models:/lora-policy/1" and ev["policy_version"] == 4
    final_eval = _metrics(module_workdir, read_state(ckpt)["tracking_run_id"], "eval/accuracy")
    assert ev["eval_accuracy"] == final_eval[-1]
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    served = mlflow.pyfunc.load_model("models:/lora-policy/1").unwrap_python_model().model
    held = {
        f"base_model.model.{n}".replace(".default.", "."): t
        for n, t in lora.adapter_weights(served)
    }
    assert held.keys() == adapter.keys()
    for name, tensor in adapter.items():
        assert torch.equal(held[name], tensor), name


@pytest.fixture(scope="module")
def fsdp_colocate_run(module_workdir: Path) -> str:
    """The final checkpoint of a colocate LoRA run on the FSDP2 backend (one rank)."""
    train = {**LORA["train"], "eval_every": 2, "backend": "fsdp"}
    run_small(module_workdir, "f.yaml", run_name="f", train=train, algorithm=LORA["algorithm"])
    return _final(module_workdir, "f")


def test_fsdp_lora_colocate_scores_its_kl_anchor_with_the_adapters_off(
    module_workdir, fsdp_colocate_run
):
    """FSDP2 LoRA colocate on one rank scores its KL anchor through the sharded policy with
    adapters off, evaluates on a copy filled with the adapter and checkpoints base + adapter +
    optimizer state. (That FSDP2 ranks train one process's adapter and resume it exactly is
    test_fsdp.py's; two ranks in an async run are test_multi_rank_trainer.py's.)"""
    final = fsdp_colocate_run
    state = read_state(final)
    assert state["policy_version"] == 4
    assert os.path.isfile(os.path.join(final, "optim", "optimizer.pt"))
    start = min(list_checkpoints(os.path.dirname(final)))
    start_base = load_file(os.path.join(start, "model.safetensors"))
    for name, tensor in load_file(os.path.join(final, "model.safetensors")).items():
        assert torch.equal(tensor, start_base[name]), name  # the base never trains
    assert any(t.abs().sum() > 0 for n, t in _adapter(final).items() if "lora_B" in n)
    assert len(_metrics(module_workdir, state["tracking_run_id"], "eval/accuracy")) >= 2
    kl = _metrics(module_workdir, state["tracking_run_id"], "train/kl")
    # The anchor is the base: the policy equals it until the adapter first trains (B starts
    # at zero), and parts from it after.
    assert abs(kl[0]) < 1e-7 and kl[-1] > 1e-6, kl
