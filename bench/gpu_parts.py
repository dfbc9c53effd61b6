"""The measurements of the GPU bring-up kit (bench/gpu_check.py runs each in its own process).

Each part returns a dict of figures; a part that cannot run on this machine raises `Skip` with
the reason. Shapes are Qwen3's published ones with random weights (nothing is downloaded).
GPU_CHECK_DEVICE=cpu with --size tiny runs the same code on the CPU (gloo instead of nccl): the
smoke test that keeps the kit working between GPU sessions (tests/unit/test_gpu_check.py).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass

import torch


class Skip(Exception):
    """This part cannot run here (the message says why)."""


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 151936


DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"

SHAPES = {
    "tiny": Shape(
        hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=512
    ),
    # Qwen3-0.6B and Qwen3-1.7B (config.json of the released models; embeddings tied)
    "0.6b": Shape(hidden=1024, intermediate=3072, layers=28, heads=16, kv_heads=8),
    "1.7b": Shape(hidden=2048, intermediate=6144, layers=28, heads=16, kv_heads=8),
}


def hf_config(shape: Shape):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=True,
        **_special_tokens(shape.vocab),
    )


def _special_tokens(vocab: int) -> dict[str, int]:
    if vocab > 151645:  # Qwen3's own
        return {"bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": 151643}
    return {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def random_policy(shape: Shape, dtype: torch.dtype = torch.float32):
    """A Qwen3 of `shape` with random weights, built on the GPU (bf16 values when `dtype` is
    float32, as a policy loaded from a bf16 checkpoint holds)."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen3ForCausalLM(hf_config(shape)).to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16))
    return model


def forward_flops(shape: Shape, seq: int, response: int) -> float:
    """Model FLOPs of one forward over a sequence of `seq` tokens whose last `response` are
    scored: the decoder's matmuls for every token, causal attention, and the LM head on the
    scored positions only (as the backends compute it)."""
    q = shape.heads * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    per_token = (
        shape.hidden * (q + 2 * kv) + q * shape.hidden + 3 * shape.hidden * shape.intermediate
    )
    decoder = 2 * per_token * seq * shape.layers
    attention = 2 * seq * seq * q * shape.layers  # QK^T and AV, half of each under the mask
    return decoder + attention + 2 * shape.hidden * shape.vocab * response


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _sync_time(fn) -> float:
    if ON_GPU:
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if ON_GPU:
        torch.cuda.synchronize()
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------- parts
def part_peak(args) -> dict:
    """The card's measured bf16 matmul peak (8192^3, mean of 10 after 3 warm-ups, 3 rounds):
    the denominator of every MFU this kit prints."""
    n = 8192 if ON_GPU else 256
    a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    rounds = [_sync_time(lambda: [a @ b for _ in range(10)]) / 10 for _ in range(3)]
    tflops = [2 * n**3 / t / 1e12 for t in rounds]
    props = torch.cuda.get_device_properties(0) if ON_GPU else None
    return {
        "device": props.name if props else "cpu",
        "memory_gib": round(props.total_memory / 2**30, 1) if props else 0.0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
        "bf16_peak_tflops": spread(tflops),
    }


def _step_batch(shape: Shape, args):
    """`args.seqs` random sequences of `args.prompt` + `args.response` tokens, split into
    micro-batches of `args.micro` sequences, with advantages +-1."""
    from relax_core.train.batch import make_micro_batch

    gen = torch.Generator().manual_seed(1)
    mbs = []
    for start in range(0, args.seqs, args.micro):
        rows = range(start, min(start + args.micro, args.seqs))
        prompts = [
            torch.randint(0, shape.vocab, (args.prompt,), generator=gen).tolist() for _ in rows
        ]
        responses = [
            torch.randint(0, shape.vocab, (args.response,), generator=gen).tolist() for _ in rows
        ]
        mbs.append(
            make_micro_batch(
                prompts,
                responses,
                [[1] * args.response for _ in rows],
                pad_token_id=0,
                extras={"advantages": [[(-1.0) ** i] * args.response for i in rows]},
            )
        )
    return mbs


def _pg_loss(tokens: float):
    def loss(logprobs, entropy, mb):
        adv, mask = mb.extras["advantages"], mb.loss_mask
        value = -(logprobs * adv * mask).sum() / tokens
        return value, {"loss": value.detach()}

    return loss


def _train_figures(backend, shape: Shape, args, peak: float) -> dict:
    """Step time, tokens/s and MFU of `backend` over the kit's step batch; the share of bf16
    weights engines receive that a 1e-6 step changed (float32 master weights at work)."""
    mbs = _step_batch(shape, args)
    loss = _pg_loss(float(args.seqs * args.response))
    before = {n: t.clone() for n, t in backend.named_weights()}
    backend.train_step(mbs, loss)  # warm-up (allocator, kernels)
    times = [_sync_time(lambda: backend.train_step(mbs, loss)) for _ in range(args.steps)]
    after = dict(backend.named_weights())
    changed = sum(int((before[n] != after[n]).sum()) for n in before)
    total = sum(t.numel() for t in before.values())
    seq = args.prompt + args.response
    flops = 3 * args.seqs * forward_flops(shape, seq, args.response)
    step = statistics.median(times)
    mfu = flops / step / (peak * 1e12) if peak > 0 else float("nan")
    if ON_GPU and peak > 0 and not 0 < mfu < 1:
        # The card's peak bounds a GPU step (on the CPU a small matmul's speed bounds nothing).
        raise RuntimeError(f"MFU {mfu:.3f} is not in (0, 1): the FLOP count or the peak is wrong")
    return {
        "step_s": spread(times),
        "tokens_per_s": args.seqs * seq / step,
        "mfu": mfu,
        "bf16_weights_changed": changed / total,
        "weights_dtype": str(next(iter(after.values())).dtype),
        "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if ON_GPU else 0.0,
    }


def part_torch(args) -> dict:
    """The torch backend: float32 master weights, bf16 autocast, AdamW at lr 1e-6."""
    from relax_core.config import TrainConfig
    from relax_core.train.torch_backend import build_backend

    shape = SHAPES[args.size]
    model = random_policy(shape)
    backend = build_backend(model, TrainConfig(lr=1e-6), 1.0, compute_dtype=torch.bfloat16)
    return {"shape": args.size, **_train_figures(backend, shape, args, args.peak)}


def part_fsdp(args) -> dict:
    """The FSDP2 backend on one rank (nccl): bf16 mixed precision over float32 master shards."""
    import torch.distributed as dist

    from relax_core.config import TrainConfig
    from relax_core.net import free_port
    from relax_core.train.fsdp import build_fsdp_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")))
    dist.init_process_group("nccl" if ON_GPU else "gloo", rank=0, world_size=1)
    if ON_GPU:
        torch.cuda.set_device(0)
    try:
        shape = SHAPES[args.size]
        backend = build_fsdp_backend(
            random_policy(shape),
            TrainConfig(lr=1e-6),
            1.0,
            device="cuda:0" if ON_GPU else "cpu",
            compute_dtype=torch.bfloat16,
        )
        return {"shape": args.size, **_train_figures(backend, shape, args, args.peak)}
    finally:
        dist.destroy_process_group()


def part_engine(args) -> dict:
    """The torch rollout engine generating on the GPU (bf16): decode tokens/s."""
    from relax_core.rollout.engine import SamplingParams
    from relax_core.rollout.torch_engine import TorchEngine

    shape = SHAPES[args.size]
    model = random_policy(shape, torch.bfloat16)
    engine = TorchEngine(model, eos_token_id=-1, pad_token_id=0, seed=0)  # no EOS: full length
    gen = torch.Generator().manual_seed(2)
    prompts = [
        torch.randint(1, shape.vocab, (args.prompt,), generator=gen).tolist()
        for _ in range(args.gen_batch)
    ]
    params = SamplingParams(max_new_tokens=args.gen_tokens)
    engine.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
    times = [_sync_time(lambda: engine.generate(prompts, params)) for _ in range(3)]
    return {
        "shape": args.size,
        "batch": args.gen_batch,
        "new_tokens": args.gen_tokens,
        "generate_s": spread(times),
        "tokens_per_s": args.gen_batch * args.gen_tokens / statistics.median(times),
    }


def part_megatron(args) -> dict:
    """Megatron-core (tp 1) built from the HF policy: log-probs agree with HF, forward/backward
    step time and MFU, and the HF names it publishes round-trip the HF weights."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise Skip(f"megatron-core is not importable ({err}); carry its wheel (.whl/)") from err
    from relax_core.config import TrainConfig
    from relax_core.net import free_port
    from relax_core.train.megatron.backend import build_megatron_backend
    from relax_core.train.megatron.config import MegatronParallel
    from relax_core.train.torch_backend import response_logprobs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port("127.0.0.1")))
    shape = SHAPES[args.size]
    hf = random_policy(shape, torch.bfloat16)
    backend = build_megatron_backend(
        hf, TrainConfig(lr=1e-6), 1.0, MegatronParallel(tp=1), dtype="bfloat16"
    )
    mbs = _step_batch(shape, args)
    with torch.no_grad():
        expected = response_logprobs(hf.eval(), mbs[0].to(DEVICE), 1.0)[0]
    got = backend.logprobs(mbs[:1])[0].to(expected.device)
    mask = mbs[0].loss_mask.bool().to(expected.device)
    logprob_gap = float((got[mask] - expected[mask]).abs().max())
    hf_state = {n: t.detach() for n, t in hf.state_dict().items()}
    mismatched = [
        n
        for n, t in backend.named_weights()
        if n in hf_state and not torch.equal(t.cpu(), hf_state[n].cpu())
    ]
    del hf, hf_state
    figures = _train_figures(backend, shape, args, args.peak)
    return {
        "shape": args.size,
        "max_logprob_gap_vs_hf": logprob_gap,
        "names_not_round_tripping": len(mismatched),
        **figures,
    }


def part_nccl(args) -> dict:
    """Our NCCL weight broadcast (BroadcastSender -> BroadcastReceiver, 1 GiB buckets) of a
    bf16 policy between two GPUs (gloo between two processes on the CPU smoke run)."""
    if ON_GPU and torch.cuda.device_count() < 2:
        raise Skip(
            "one GPU: NCCL refuses two ranks on one device; the same broadcast code runs over "
            "gloo in the CPU tests (tests/integration/test_weight_sync.py)"
        )
    import subprocess
    import sys
    import tempfile

    root = tempfile.mkdtemp(prefix="gpu-check-sync-")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"} if ON_GPU else dict(os.environ)
    receiver = subprocess.Popen(
        [
            sys.executable, "-m", "bench.gpu_check", "--part", "nccl_receiver",
            "--root", root, "--size", args.size,
        ],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        figures = _nccl_send(args, root)
    finally:
        out, _ = receiver.communicate(timeout=600)
    got = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if " {" in line]
    figures["receiver"] = got[-1] if got else f"no result (exit {receiver.returncode})"
    return figures


def _policy_specs(shape: Shape):
    from relax_core.sync import TensorSpec

    model = random_policy(shape, torch.bfloat16)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    return [TensorSpec(n, tuple(t.shape), "bfloat16") for n, t in named], named


def _nccl_send(args, root: str) -> dict:
    from relax_core.queue.store import ObjectStore
    from relax_core.sync import BroadcastSender

    specs, named = _policy_specs(SHAPES[args.size])
    sender = BroadcastSender(
        ObjectStore(root, durable=False),
        "gpucheck",
        ["r1"],
        specs,
        bucket_bytes=1 << 30,
        backend="nccl" if ON_GPU else "gloo",
    )
    sender.init()
    sender.push(named, 1)  # warm-up: NCCL communicator set-up
    times = [_sync_time(lambda v=v: sender.push(named, v)) for v in range(2, 5)]
    sender.destroy()
    nbytes = sum(s.nbytes for s in specs)
    return {
        "bytes": nbytes,
        "buckets": len(sender.buckets),
        "push_s": spread(times),
        "gb_per_s": nbytes / statistics.median(times) / 1e9,
    }


def part_nccl_receiver(args) -> dict:
    from relax_core.queue.store import ObjectStore
    from relax_core.sync import BroadcastReceiver

    if ON_GPU:
        torch.cuda.set_device(0)
    specs, _ = _policy_specs(SHAPES[args.size])
    receiver = BroadcastReceiver(
        ObjectStore(args.root, durable=False), "gpucheck", "r1", specs, bucket_bytes=1 << 30
    )
    receiver.init()
    receiver.start()
    seen = 0
    while not receiver.stopped:
        if receiver.wait(1.0):
            got = receiver.take()
            if got is not None:
                seen = got[0]
                receiver.release(got)
    receiver.destroy()
    return {"versions_received": seen}


PARTS = {
    "peak": part_peak,
    "torch": part_torch,
    "fsdp": part_fsdp,
    "engine": part_engine,
    "megatron": part_megatron,
    "nccl": part_nccl,
    "nccl_receiver": part_nccl_receiver,
}
