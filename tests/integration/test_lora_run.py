"""LoRA runs end to end: colocate and async (adapters over the gloo broadcast group) train the
same adapter at max_staleness 0, the base never moves, and each checkpoint is base + adapter."""

from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file

from relax_core.models.lora import ADAPTER_DIR
from relax_core.train.checkpoint import list_checkpoints, read_state
from tests.integration.test_async_run import ASYNC, _final, _finish, _run

pytestmark = pytest.mark.integration

LORA = {
    "train": {"total_steps": 4, "checkpoint_every": 2, "lr": 5e-3, "lora": {"rank": 4}},
    # The entropy bonus gives every step a gradient; the KL term scores the base policy, the
    # LoRA policy with its adapters off (colocate) or the starting policy (async's reference).
    "algorithm": {"entropy_coef": 0.01, "kl_coef": 0.01},
}


def _adapter(ckpt: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(ckpt, ADAPTER_DIR, "adapter_model.safetensors"))


def test_lora_trains_the_same_adapter_in_both_modes_on_a_frozen_base(small_config, workdir):
    _finish(_run(small_config("c.yaml", run_name="c", **LORA)))
    _finish(_run(small_config("a.yaml", run_name="a", **LORA, **ASYNC)))

    c_ckpt, a_ckpt = _final(workdir, "c"), _final(workdir, "a")
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
