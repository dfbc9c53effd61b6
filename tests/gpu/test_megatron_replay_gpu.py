"""MegatronBackend with routing replay on one GPU (tp=1), a tiny Qwen3-MoE (layer 0 dense, layer 1
MoE): replaying the experts the HF model routes to gives the HF log-probs, replaying other experts
gives what the HF model gives when it replays those, and the routers are left clean."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core")

from relax_core.models.routing_replay import attach_routing_replay  # noqa: E402
from relax_core.net import free_port  # noqa: E402
from relax_core.train.batch import make_micro_batch  # noqa: E402
from relax_core.train.megatron.backend import MegatronBackend  # noqa: E402
from relax_core.train.megatron.config import MegatronParallel  # noqa: E402
from relax_core.train.torch_backend import response_logprobs  # noqa: E402
from tests.unit.test_megatron_convert import moe  # noqa: E402

pytestmark = pytest.mark.gpu

K = 2  # num_experts_per_tok of tests.unit.test_megatron_convert.moe


@pytest.fixture(scope="module")
def setup():
    from transformers import Qwen3MoeForCausalLM

    os.environ.setdefault("MASTER_PORT", str(free_port("127.0.0.1")))
    config, hf_state = moe(mlp_only_layers=[0])
    config.router_aux_loss_coef = 0.0  # R3 runs train without the load-balancing loss
    # Larger experts, so which experts a token goes to visibly moves its log-probs (at the
    # initializer's scale, moving every expert changes them by < 0.01).
    hf_state = {n: t * 5 if ".mlp.experts." in n else t for n, t in hf_state.items()}
    backend = MegatronBackend(
        config,
        hf_state,
        MegatronParallel(tp=1),
        lr=1e-3,
        dtype="float32",
        max_sequence_length=64,
        routing_replay=True,
    )
    hf = Qwen3MoeForCausalLM(config).eval()
    hf.load_state_dict(hf_state, strict=False)
    attach_routing_replay(hf)
    return config, backend, hf


def batch():
    torch.manual_seed(1)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (5, 3, 7)]
    responses = [torch.randint(0, 256, (n,)).tolist() for n in (4, 6, 2)]
    masks = [[1] * len(r) for r in responses]
    return make_micro_batch(prompts, responses, masks, pad_token_id=0)


def hf_experts(hf, mb) -> torch.Tensor:
    """[B, S, num_layers * K]: the experts the HF model's own routers pick for mb's tokens."""
    from relax_core.models.routing_replay import routing_of

    with torch.no_grad(), routing_of(hf).capture() as cap:
        hf.get_decoder()(input_ids=mb.input_ids, attention_mask=mb.attention_mask)
    return cap.tokens(mb.num_seqs).reshape(*mb.input_ids.shape, -1)


def hf_logprobs(hf, mb) -> torch.Tensor:
    with torch.no_grad():
        return response_logprobs(hf, mb, temperature=1.0)[0]


def test_replaying_the_routers_own_experts_gives_hf_logprobs(setup):
    _, backend, hf = setup
    mb = batch()
    own = dataclasses.replace(mb, routed_experts=hf_experts(hf, mb))
    (got,) = backend.logprobs([own])
    mask = mb.loss_mask.bool()
    torch.testing.assert_close(got[mask], hf_logprobs(hf, own)[mask], atol=1e-3, rtol=0)


def test_replaying_other_experts_changes_logprobs_as_hf_replay_does(setup):
    _, backend, hf = setup
    mb = batch()
    experts = hf_experts(hf, mb)
    other = experts.clone()
    other[..., K : 2 * K] = (experts[..., K : 2 * K] + 1) % 4  # layer 1: every expert moved
    own_mb = dataclasses.replace(mb, routed_experts=experts)
    other_mb = dataclasses.replace(mb, routed_experts=other)
    own, moved = backend.logprobs([own_mb, other_mb])
    mask = mb.loss_mask.bool()
    assert (own[mask] - moved[mask]).abs().max() > 0.05
    torch.testing.assert_close(moved[mask], hf_logprobs(hf, other_mb)[mask], atol=1e-3, rtol=0)


def test_train_step_replays_and_leaves_routers_clean(setup):
    _, backend, hf = setup
    mb = batch()
    replayed = dataclasses.replace(mb, routed_experts=hf_experts(hf, mb))

    def mean_nll(logprobs, entropy, mb):
        mask = mb.loss_mask.to(logprobs.device)
        loss = -(logprobs * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    metrics = backend.train_step([replayed], mean_nll)
    assert metrics["skipped_step"] == 0.0 and metrics["grad_norm"] > 0
    assert all(
        r.router_replay_action is None and r.target_topk_idx is None for r in backend._replays
    )
    # The router weights got gradients through the replayed experts' probabilities.
    router = backend.model.decoder.layers[1].mlp.router
    assert router.weight.main_grad.abs().sum() > 0
    with pytest.raises(ValueError, match="no routed_experts"):
        backend.logprobs([mb])
