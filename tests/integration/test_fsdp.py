"""FSDP2 backend on 2 CPU ranks (gloo) against the single-process torch backend.

Three policies: float32; bf16 on float32 master weights; LoRA (a bf16 base under float32
adapters). For each, two training steps over the same 5 micro-batches (rank 0 takes 3, rank 1
takes 2 and one zero-weighted pad) must give the weights and metrics one process gives, and a
checkpoint saved after step 1 and resumed in fresh processes must make the same step 2 as running
on. One pair of rank processes trains all three policies and a second, fresh pair resumes them
(the module's `ranks` fixture); each test reads what its policy left.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from relax_core.algorithms import LossInputs, LossSettings, grpo_loss
from relax_core.config import ModelConfig, TrainConfig
from relax_core.models.lora import ADAPTER_DIR, adapters_disabled, attach_lora, load_adapter
from relax_core.models.tiny import build_tiny_qwen3
from relax_core.train.batch import MicroBatch, make_micro_batch
from relax_core.train.fsdp import decoder_layers
from relax_core.train.torch_backend import build_backend
from tests.s3servers import free_ports

SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
VOCAB = 64
TRAIN = TrainConfig(lr=1e-3, grad_clip=1.0, warmup_steps=2)
LORA_TARGETS = "q_proj,v_proj,down_proj"
ROWS = [3, 1, 2, 2, 1]  # rows per micro-batch: uneven, so the metrics' row weighting matters
# Each policy the ranks train: (bf16, lora), as _train_policy takes them.
POLICIES = {"float32": (False, False), "bf16": (True, False), "lora": (True, True)}
# One spawn (two rank processes importing torch and transformers, three policies) took 8 s on
# an idle 2-core machine and 70 s under a load of 20; both stay inside the test's bound (300 s).
SPAWN_TIMEOUT_S = 120.0


def _micro_batches(step: int) -> list[MicroBatch]:
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for rows in ROWS:
        lens = [
            (
                int(torch.randint(2, 6, (), generator=gen)),
                int(torch.randint(1, 5, (), generator=gen)),
            )
            for _ in range(rows)
        ]
        prompts = [torch.randint(4, VOCAB, (p,), generator=gen).tolist() for p, _ in lens]
        responses = [torch.randint(4, VOCAB, (r,), generator=gen).tolist() for _, r in lens]
        adv = [float(torch.randn((), generator=gen)) for _ in range(rows)]
        out.append(
            make_micro_batch(
                prompts,
                responses,
                [[1] * len(r) for r in responses],
                pad_token_id=0,
                extras={"advantages": [[a] * len(r) for a, r in zip(adv, responses, strict=True)]},
            )
        )
    return out


def _loss_fn(mbs: list[MicroBatch]):
    num_tokens = float(sum(mb.loss_mask.sum() for mb in mbs))

    def loss_fn(logprobs, entropy, mb):
        # A fixed proximal policy a little off the current one, so the ratio is not 1.
        old = logprobs.detach() + 0.1 * mb.extras["advantages"].sign()
        inputs = LossInputs(logprobs, old, mb.extras["advantages"], mb.loss_mask)
        return grpo_loss(inputs, LossSettings(), num_tokens=num_tokens)

    return loss_fn


def _lora_policy(bf16: bool):
    """The tiny policy as a LoRA run trains it: the base in bf16 (`bf16`) or float32, frozen,
    with float32 rank-4 adapters."""
    model = build_tiny_qwen3(SMALL, VOCAB, seed=0)
    if bf16:  # as loaded from a bf16 policy: parameters in bf16, buffers (rotary) in float32
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
    return attach_lora(model, 4, 8.0, 0.0, LORA_TARGETS, seed=0)


def _rank_main(rank: int, port: int, out: str, resume: bool) -> None:
    """One FSDP rank of a fresh pair: each policy of POLICIES in turn, under `out`/<policy>."""
    import faulthandler

    import torch.distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # _spawn asks for stacks past time
    torch.set_num_threads(1)  # this rank process's own: two ranks share the machine's cores
    init = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        for name, (bf16, lora) in POLICIES.items():
            os.makedirs(os.path.join(out, name), exist_ok=True)
            _train_policy(rank, os.path.join(out, name), resume, bf16, lora)
    finally:
        dist.destroy_process_group()


def _train_policy(rank: int, out: str, resume: bool, bf16: bool, lora: bool) -> None:
    """One FSDP rank: steps 1 and 2 (saving after step 1), or step 2 resumed from that save;
    `bf16`: a bf16 policy on float32 master weights (FSDP2 mixed precision), or with `lora` a
    bf16 base under float32 adapters."""
    from transformers import AutoModelForCausalLM

    from relax_core.train.fsdp import build_fsdp_backend

    ckpt = os.path.join(out, "ckpt")
    if resume:
        dtype = torch.bfloat16 if lora and bf16 else torch.float32
        model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype)
        if lora:
            load_adapter(model, ckpt)
    elif lora:
        model = _lora_policy(bf16)
    else:
        model = build_tiny_qwen3(SMALL, VOCAB, seed=0)
        if bf16:  # parameters as loaded from a bf16 policy (buffers stay float32)
            with torch.no_grad():
                for param in model.parameters():
                    param.copy_(param.to(torch.bfloat16))
    compute = torch.bfloat16 if bf16 else None
    backend = build_fsdp_backend(model, TRAIN, temperature=0.9, compute_dtype=compute)
    if resume:
        backend.load(ckpt)
    metrics = {}
    for step in (1, 2):
        if resume and step == 1:
            continue
        mbs = _micro_batches(step)
        if step == 1:
            logps = backend.logprobs(mbs)
        metrics[step] = backend.train_step(mbs, _loss_fn(mbs))
        if step == 1:
            backend.save(ckpt)
    weights = {n: w.clone() for n, w in backend.named_weights()}
    if lora:  # the KL reference of a LoRA run: the sharded policy with its adapters off
        with adapters_disabled(backend.model):
            base = backend.logprobs(_micro_batches(1))
        trained = backend.logprobs(_micro_batches(1))
    if rank == 0 and lora:
        save_file({str(i): t for i, t in enumerate(base)}, os.path.join(out, "base.st"))
        save_file({str(i): t for i, t in enumerate(trained)}, os.path.join(out, "on.st"))
    if rank == 0:
        tag = "resumed" if resume else "fsdp"
        save_file(weights, os.path.join(out, f"{tag}.safetensors"))
        with open(os.path.join(out, f"{tag}.json"), "w") as f:
            json.dump(metrics, f)
        if not resume:
            save_file(
                {str(i): t for i, t in enumerate(logps)}, os.path.join(out, "logps.safetensors")
            )


def _spawn(out: str, resume: bool) -> None:
    """Two fresh rank processes through every policy; past SPAWN_TIMEOUT_S they print their
    stacks (to the test's captured stderr), are killed, and the test fails. (mp.spawn's own join
    has no deadline.)"""
    import torch.multiprocessing as mp

    (port,) = free_ports(1)
    ranks = mp.spawn(_rank_main, args=(port, out, resume), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not ranks.join(timeout=max(deadline - time.monotonic(), 0.0)):
        if time.monotonic() < deadline:
            continue
        alive = [p for p in ranks.processes if p.is_alive()]
        for p in alive:
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(1.0)
        for p in alive:
            p.kill()
            p.join()
        what = "resumed" if resume else "trained"
        pytest.fail(
            f"the FSDP ranks {[p.pid for p in alive]} had not {what} every policy within "
            f"{SPAWN_TIMEOUT_S:.0f} s; those past their imports printed their stacks (captured "
            "stderr)",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Per policy of POLICIES, the directory its two ranks left: `ckpt` (saved after step 1),
    fsdp.safetensors/.json (weights and metrics after step 2 run on), resumed.safetensors/.json
    (step 2 resumed from `ckpt`), logps.safetensors (step 1's log-probs) and, for LoRA, base.st
    and on.st (log-probs with the adapters off and on)."""
    out = str(tmp_path_factory.mktemp("fsdp"))
    _spawn(out, resume=False)
    _spawn(out, resume=True)
    return {name: os.path.join(out, name) for name in POLICIES}


@pytest.mark.slow
@pytest.mark.integration
def test_fsdp_two_ranks_match_one_process_and_resume(ranks):
    out = ranks["float32"]

    backend = build_backend(build_tiny_qwen3(SMALL, VOCAB, seed=0), TRAIN, temperature=0.9)
    mbs1 = _micro_batches(1)
    logps = backend.logprobs(mbs1)
    expected = {1: backend.train_step(mbs1, _loss_fn(mbs1))}
    after_step1 = {n: w.clone() for n, w in backend.named_weights()}
    mbs2 = _micro_batches(2)
    expected[2] = backend.train_step(mbs2, _loss_fn(mbs2))
    after_step2 = dict(backend.named_weights())

    fsdp_logps = load_file(os.path.join(out, "logps.safetensors"))
    for i, logp in enumerate(logps):
        torch.testing.assert_close(fsdp_logps[str(i)], logp, rtol=1e-5, atol=1e-6)

    with open(os.path.join(out, "fsdp.json")) as f:
        fsdp_metrics = json.load(f)
    for step in (1, 2):
        got = fsdp_metrics[str(step)]
        assert got.keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)

    # The checkpoint is an ordinary HF directory holding the weights after step 1.
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(os.path.join(out, "ckpt"))
    for name, param in saved.named_parameters():
        torch.testing.assert_close(param.detach(), after_step1[name], rtol=1e-5, atol=1e-6)

    fsdp = load_file(os.path.join(out, "fsdp.safetensors"))
    resumed = load_file(os.path.join(out, "resumed.safetensors"))
    assert fsdp.keys() == after_step2.keys() == resumed.keys()
    for name, weight in after_step2.items():
        torch.testing.assert_close(fsdp[name], weight, rtol=1e-5, atol=1e-6)
        # Same processes' count, same shards, same optimizer state: bit-for-bit the same step.
        torch.testing.assert_close(resumed[name], fsdp[name], rtol=0, atol=0)
    with open(os.path.join(out, "resumed.json")) as f:
        assert json.load(f)["2"] == pytest.approx(fsdp_metrics["2"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.integration
def test_fsdp_bf16_policy_keeps_float32_master_weights_across_a_resume(ranks):
    from relax_core.train.backend import MASTER_WEIGHTS_FILE
    from relax_core.train.fsdp import OPTIMIZER_DIR

    out = ranks["bf16"]

    # The policy engines and evaluation load is bf16; the master weights travel beside the
    # optimizer state in float32 and differ from it by less than a bf16 rounding.
    policy = load_file(os.path.join(out, "ckpt", "model.safetensors"))
    master = load_file(os.path.join(out, "ckpt", OPTIMIZER_DIR, MASTER_WEIGHTS_FILE))
    assert {t.dtype for t in policy.values()} == {torch.bfloat16}
    assert {t.dtype for t in master.values()} == {torch.float32}
    assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in master.values())
    for name, weight in master.items():
        assert torch.equal(policy[name], weight.to(torch.bfloat16)), name

    fsdp = load_file(os.path.join(out, "fsdp.safetensors"))
    resumed = load_file(os.path.join(out, "resumed.safetensors"))
    assert {t.dtype for t in fsdp.values()} == {torch.bfloat16}  # what the engines receive
    for name, weight in fsdp.items():
        # The resumed step started from the float32 master, not the bf16 policy: identical.
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.integration
def test_fsdp_lora_trains_what_one_process_trains_and_resumes_exactly(ranks):
    out = ranks["lora"]

    backend = build_backend(_lora_policy(bf16=True), TRAIN, 0.9, compute_dtype=torch.bfloat16)
    start = backend.logprobs(_micro_batches(1))
    mbs1 = _micro_batches(1)
    expected = {1: backend.train_step(mbs1, _loss_fn(mbs1))}
    after_step1 = {n: w.clone() for n, w in backend.named_weights()}
    mbs2 = _micro_batches(2)
    expected[2] = backend.train_step(mbs2, _loss_fn(mbs2))
    after_step2 = dict(backend.named_weights())

    # Only the adapter travels, in float32, and it matches one process's after two steps.
    fsdp = load_file(os.path.join(out, "fsdp.safetensors"))
    assert fsdp.keys() == after_step2.keys()
    assert all(".lora_A." in n or ".lora_B." in n for n in fsdp)
    assert {t.dtype for t in fsdp.values()} == {torch.float32}
    assert any(t.abs().sum() > 0 for n, t in fsdp.items() if ".lora_B." in n)  # it trained
    for name, weight in after_step2.items():
        torch.testing.assert_close(fsdp[name], weight, rtol=1e-4, atol=1e-6)
    with open(os.path.join(out, "fsdp.json")) as f:
        got = json.load(f)
    for step in (1, 2):
        for key, value in expected[step].items():
            assert got[str(step)][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)

    # The checkpoint is the frozen bf16 base under plain names plus the step-1 adapter in
    # PEFT's format; resumed in fresh processes, step 2 is bit-for-bit the same.
    ckpt = os.path.join(out, "ckpt")
    policy = load_file(os.path.join(ckpt, "model.safetensors"))
    plain = build_tiny_qwen3(SMALL, VOCAB, seed=0).state_dict()
    assert policy.keys() <= plain.keys() and "model.embed_tokens.weight" in policy
    for name, tensor in policy.items():
        assert torch.equal(tensor, plain[name].to(torch.bfloat16)), name  # the base never trains
    adapter = load_file(os.path.join(ckpt, ADAPTER_DIR, "adapter_model.safetensors"))
    assert len(adapter) == len(after_step1)
    resumed = load_file(os.path.join(out, "resumed.safetensors"))
    for name, weight in fsdp.items():
        torch.testing.assert_close(resumed[name], weight, rtol=0, atol=0)

    # The sharded policy with adapters off scores as the starting policy (B starts at zero);
    # with them on it scores as one process's trained policy.
    base, trained = load_file(os.path.join(out, "base.st")), load_file(os.path.join(out, "on.st"))
    final = backend.logprobs(_micro_batches(1))
    for i, logp in enumerate(start):
        torch.testing.assert_close(base[str(i)], logp, rtol=0, atol=1e-6)
        torch.testing.assert_close(trained[str(i)], final[i], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(trained[str(i)], logp, atol=1e-4)


def test_layer_finder_names_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="Sequential has no decoder layers"):
        decoder_layers(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()))
    model = build_tiny_qwen3(SMALL, VOCAB, seed=0)
    assert decoder_layers(model) == list(model.model.layers)[::-1]
