"""train.activation_checkpointing on the torch backend (the FSDP2 backend builds the same
model through it): the same loss and gradients as without, and fewer bytes kept for backward,
measured on a CPU with autograd's saved-tensor hooks."""

from __future__ import annotations

import copy

import pytest
import torch

from relax_core.config import ModelConfig, TrainConfig
from relax_core.models.tiny import build_tiny_qwen3
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import build_backend


def _policy():
    cfg = ModelConfig(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=256
    )
    return build_tiny_qwen3(cfg, vocab_size=79, seed=0)


def _micro_batch(share_prompts: bool = False):
    """Four rows; with `share_prompts` two groups of two rows repeating a prompt, which the
    backend runs once per group (train/shared_prompts.py)."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 79, (24,), generator=gen).tolist() for _ in range(4)]
    if share_prompts:
        prompts = [prompts[0], prompts[0], prompts[1], prompts[1]]
    responses = [torch.randint(4, 79, (40 - i,), generator=gen).tolist() for i in range(4)]
    advantages = [[1.0 if i % 2 else -0.5] * len(r) for i, r in enumerate(responses)]
    return make_micro_batch(
        prompts,
        responses,
        [[1] * len(r) for r in responses],
        pad_token_id=0,
        extras={"advantages": advantages},
        share_prompts=share_prompts,
    )


def _loss(logprobs, entropy, mb):
    value = -(logprobs * mb.extras["advantages"] * mb.loss_mask).sum() / mb.loss_mask.sum()
    return value, {"loss": value.detach()}


def _checkpointed(model) -> bool:
    return any(getattr(layer, "gradient_checkpointing", False) for layer in model.model.layers)


def saved_activation_bytes(backend, mb) -> int:
    """Bytes the forward of `mb` keeps for backward: every tensor autograd saves (each storage
    once, parameters left out) plus the input each checkpointed layer keeps to recompute from."""
    params = {p.untyped_storage().data_ptr() for p in backend.model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def keep_input(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        storages[hidden.untyped_storage().data_ptr()] = hidden.untyped_storage().nbytes()

    layers = backend.model.model.layers if _checkpointed(backend.model) else []
    hooks = [layer.register_forward_pre_hook(keep_input, with_kwargs=True) for layer in layers]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs, entropy = backend._forward(mb)
            _loss(logprobs, entropy, mb)[0].backward()
    finally:
        for h in hooks:
            h.remove()
    return sum(storages.values())


@pytest.fixture(scope="module")
def backends():
    plain = _policy()
    recomputing = copy.deepcopy(plain)
    train = TrainConfig(lr=1e-2)
    return (
        build_backend(plain, train, 1.0),
        build_backend(recomputing, train, 1.0, activation_checkpointing=True),
    )


@pytest.mark.parametrize("share_prompts", [False, True])
def test_checkpointing_gives_the_same_loss_and_gradients(backends, share_prompts):
    mb = _micro_batch(share_prompts)
    assert (mb.shared is not None) == share_prompts
    results = []
    for backend in backends:
        backend.optimizer.zero_grad(set_to_none=True)
        metrics = backend.accumulate_gradients([mb], _loss, mb.num_seqs)
        grads = {n: p.grad.clone() for n, p in backend.model.named_parameters()}
        results.append((metrics["loss"], grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-7)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads_a.values())


def test_checkpointing_keeps_fewer_activation_bytes(backends):
    plain, recomputing = backends
    assert not _checkpointed(plain.model)
    assert _checkpointed(recomputing.model)
    mb = _micro_batch()
    without = saved_activation_bytes(plain, mb)
    with_ckpt = saved_activation_bytes(recomputing, mb)
    print(f"saved activation bytes: {without:,} without, {with_ckpt:,} with checkpointing")
    # Four layers: each keeps its input instead of everything its backward needs; the LM head,
    # the log-softmax and the final norm are kept either way.
    assert with_ckpt < 0.25 * without


@pytest.fixture
def gloo_group():
    """A world-size-1 gloo group, as the FSDP2 backend forms for a one-GPU trainer."""
    import torch.distributed as dist

    from relax_core.net import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_checkpointing_on_the_packed_shared_prompt_path():
    """Under float32 attention (model.matmul_dtype) rows sharing a prompt run packed in one pass,
    which needs no KV cache: checkpointing keeps that path and its gradients."""
    from relax_core.models.attention import use_float32_attention
    from relax_core.train.shared_prompts import runs_shared

    plain = _policy()
    use_float32_attention(plain)
    recomputing = copy.deepcopy(plain)
    mb = _micro_batch(share_prompts=True)
    grads = []
    for model, ckpt in ((plain, False), (recomputing, True)):
        backend = build_backend(model, TrainConfig(), 1.0, activation_checkpointing=ckpt)
        assert runs_shared(model, mb)
        backend.accumulate_gradients([mb], _loss, mb.num_seqs)
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_fsdp2_checkpointing_gives_the_same_loss_and_gradients(gloo_group):
    from relax_core.train.fsdp import build_fsdp_backend

    mb = _micro_batch()
    plain = _policy()
    recomputing = copy.deepcopy(plain)
    results = []
    for model, ckpt in ((plain, False), (recomputing, True)):
        backend = build_fsdp_backend(
            model, TrainConfig(lr=1e-2), 1.0, activation_checkpointing=ckpt
        )
        metrics = backend.train_step([mb], _loss)
        weights = {n: w.clone() for n, w in backend.named_weights()}
        results.append((metrics["loss"], metrics["grad_norm"], weights))
    (loss_a, norm_a, after_a), (loss_b, norm_b, after_b) = results
    assert _checkpointed(recomputing) and not _checkpointed(plain)
    assert loss_a == pytest.approx(loss_b, abs=1e-7)
    assert norm_a == pytest.approx(norm_b, rel=1e-5) and norm_a > 0
    for name in after_a:  # the same gradients make the same AdamW step
        torch.testing.assert_close(after_b[name], after_a[name], rtol=1e-5, atol=1e-6)


def test_megatron_recompute_is_full_per_layer():
    from transformers import Qwen3Config

    from relax_core.train.megatron.config import MegatronParallel, transformer_config_kwargs

    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    assert "recompute_granularity" not in transformer_config_kwargs(config, MegatronParallel())
    kwargs = transformer_config_kwargs(config, MegatronParallel(recompute=True))
    assert (kwargs["recompute_granularity"], kwargs["recompute_method"]) == ("full", "uniform")
    assert kwargs["recompute_num_layers"] == 1
