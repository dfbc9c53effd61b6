"""The GPU bring-up kit's `plan` part: the memory plan (relax_core/plan) against the peaks
measured here, at the Qwen3-4B shape on one GPU.

One torch backend (float32 master weights, bf16 autocast, AdamW) trains micro-batches of 2k, 4k
and 16k tokens (sequences of --prompt + --response), with activation checkpointing off and then
on. Each case's `torch.cuda.max_memory_allocated` over one step (optimizer state already made by
a warm-up step) is set beside the plan's trainer parts for the same settings (what the allocator
holds: the CUDA context is outside it). A case the plan says cannot fit on this card is skipped
with the plan's figure; one that runs out of memory anyway is recorded as such. Each case is
reported as soon as it is measured (`args.progress`, which bench/gpu_check.py gives each part),
so a part stopped at its bound keeps what it had.

The plan takes a run config; `_plan_config` is the small adapter from the kit's settings to one
(the torch backend, model.dtype bfloat16 over float32 masters, one trainer GPU).
"""

from __future__ import annotations

import sys

import torch

from bench import gpu_parts as g

PLAN_SIZES = ("4b", "tiny")


def plan_shape(size: str):
    """The plan's shape for `size`: Qwen3-4B's published one, or the kit's tiny one."""
    from relax_core.plan.shapes import KNOWN, Shape

    if size == "4b":
        return KNOWN["Qwen/Qwen3-4B"]
    t = g.SHAPES["tiny"]
    return Shape(t.hidden, t.intermediate, t.layers, t.heads, t.kv_heads, t.head_dim, t.vocab, True)


def kit_shape(shape) -> g.Shape:
    return g.Shape(
        shape.hidden, shape.intermediate, shape.layers, shape.heads, shape.kv_heads,
        shape.head_dim, shape.vocab,
    )  # fmt: skip


def _plan_config():
    from relax_core.config import RunConfig, replace

    return replace(RunConfig(), model={"dtype": "bfloat16"}, train={"backend": "torch"})


def predicted(shape, seq: int, response: int, tokens: int, ckpt: bool) -> dict:
    """The plan's trainer parts (bytes) for one GPU at `tokens` per micro-batch."""
    from relax_core.plan.memory import Lengths, trainer_parts

    parts = trainer_parts(_plan_config(), shape, Lengths(seq, response, tokens), ckpt)
    return {part.name: part.bytes for part in parts}


def card_memory() -> tuple[str, int]:
    """This card's name and total memory; on the CPU smoke run, the planned-for default card."""
    from relax_core.plan.devices import CARDS, DEFAULT_CARD

    if g.ON_GPU:
        props = torch.cuda.get_device_properties(0)
        return props.name, props.total_memory
    card = CARDS[DEFAULT_CARD]
    return f"{card.name} (planned; CPU run)", card.memory


def _case_args(args, tokens: int):
    """The kit's step batch settings for one micro-batch of `tokens` tokens."""
    seq = args.prompt + args.response
    n = max(1, tokens // seq)
    return type(args)(**{**vars(args), "seqs": n, "micro": n})


def _measure(backend, shape: g.Shape, args) -> int | None:
    """Peak bytes the allocator held over one training step (None on the CPU)."""
    mbs = g._step_batch(shape, args)
    loss = g._pg_loss(float(args.seqs * args.response))
    if g.ON_GPU:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    backend.train_step(mbs, loss)
    if not g.ON_GPU:
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def run_case(backend, shape: g.Shape, plan, args, tokens: int, ckpt: bool, room: int) -> dict:
    from relax_core.plan.parts import CUDA_CONTEXT

    seq = args.prompt + args.response
    parts = predicted(plan, seq, args.response, tokens, ckpt)
    plan_bytes = sum(parts.values())
    case = {"tokens": tokens, "checkpointing": ckpt, "plan_bytes": plan_bytes}
    case["plan_gib"] = round(plan_bytes / 2**30, 2)
    if plan_bytes + CUDA_CONTEXT > room:
        need = (plan_bytes + CUDA_CONTEXT) / 2**30
        case.update(status="skipped", why=f"the plan needs {need:.1f} GiB of {room / 2**30:.1f}")
        return case
    try:
        peak = _measure(backend, shape, _case_args(args, tokens))
    except torch.cuda.OutOfMemoryError as err:
        torch.cuda.empty_cache()
        return {**case, "status": "out_of_memory", "error": str(err).splitlines()[0]}
    case["status"] = "ok"
    if peak is not None:
        case["measured_bytes"] = peak
        case["measured_gib"] = round(peak / 2**30, 2)
        case["plan_error"] = round(plan_bytes / peak - 1, 4)
    return case


def part_plan(args) -> dict:
    """Memory plan vs measured peaks at the --plan-size shape, checkpointing off then on."""
    from relax_core.config import TrainConfig
    from relax_core.train.recompute import use_activation_checkpointing
    from relax_core.train.torch_backend import build_backend

    plan = plan_shape(args.plan_size)
    shape = kit_shape(plan)
    name, room = card_memory()
    tokens = [int(t) for t in args.plan_tokens.split(",")]
    out: dict = {"shape": args.plan_size, "card": name, "card_gib": round(room / 2**30, 1)}
    out["cases"] = []
    backend = build_backend(
        g.random_policy(shape), TrainConfig(lr=1e-6), 1.0, compute_dtype=torch.bfloat16
    )
    warmed = False
    for ckpt in (False, True):
        if ckpt:
            use_activation_checkpointing(backend.model)
        for n in tokens:
            if not warmed:  # AdamW's state is made by the first step: measure after it
                warm = run_case(backend, shape, plan, args, n, ckpt, room)
                warmed = warm["status"] == "ok"
                if not warmed:
                    out["cases"].append(warm)
                    args.progress(out)
                    continue
            out["cases"].append(run_case(backend, shape, plan, args, n, ckpt, room))
            args.progress(out)
    errors = [abs(c["plan_error"]) for c in out["cases"] if "plan_error" in c]
    out["max_abs_plan_error"] = max(errors) if errors else None
    return out


if __name__ == "__main__":
    sys.exit("run through bench/gpu_check.py --parts plan")
