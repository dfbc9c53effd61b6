"""bfloat16 matmuls in a float32 policy (`model.matmul_dtype`): the trainer's autocast numerics
in an inference copy.

The trainer keeps float32 weights and runs its forward under autocast to bfloat16 with float32
attention: linear layers compute in bfloat16, the residual stream, norms, attention and softmax
in float32. `linear_layers_in` gives an inference copy (the torch engine's, the KL reference's)
the same numerics, bit for bit, without autocast re-casting every weight at every decode step:
its linear layers hold their weights in bfloat16 (the value autocast casts them to) and cast
their input to it, and attention runs in float32. An LM head tied to the input embeddings keeps
the shared float32 weight (embedding rows rounded to bfloat16 moved SmolLM2-135M's log-probs by
0.04 a token) and multiplies by a bfloat16 copy of it, made again after each weight update.

Why not a bfloat16 copy: with the residual stream in bfloat16 too, SmolLM2-135M's samples were
worse (held-out 0.68 against 0.93 after 5 GRPO steps, mean of 3 seeds, 2026-11-25).
"""

from __future__ import annotations

import functools

import torch
from torch.nn import functional as F

from relax_core.models.attention import use_float32_attention


class TiedHead(torch.nn.Module):
    """An LM head that shares the input embeddings' float32 weight and computes in `dtype` on a
    copy of it, cast again whenever the weight changed (its version counter moved)."""

    def __init__(self, weight: torch.nn.Parameter, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = weight
        self.dtype = dtype
        self._cast: torch.Tensor | None = None
        self._cast_version = -1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._cast is None or self._cast_version != self.weight._version:
            self._cast = self.weight.detach().to(self.dtype)
            self._cast_version = self.weight._version
        return F.linear(hidden.to(self.dtype), self._cast)


def _input_in_weight_dtype(module: torch.nn.Linear, args: tuple) -> tuple:
    return (args[0].to(module.weight.dtype), *args[1:])


def linear_layers_in(model, dtype: torch.dtype):
    """`model` (a float32 transformers causal LM used for inference) with its linear layers in
    `dtype` and everything else in float32, computing as the trainer does under autocast to
    `dtype`. In place; returns `model`. Weight sync copies float32 weights into it, each linear
    layer's rounded to `dtype` as autocast rounds it."""
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight
    if tied and head.bias is not None:
        raise ValueError(f"{type(model).__name__}: a tied LM head with a bias is not supported")
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and not (tied and module is head):
            module.to(dtype)
            module.register_forward_pre_hook(_input_in_weight_dtype)
    if tied:
        model.set_output_embeddings(TiedHead(head.weight, dtype))
    use_float32_attention(model)
    return model


def computing_as_trainer(model, matmul_dtype: str):
    """`model` (a float32 inference copy: an engine's, a scorer's) computing as the trainer does
    under `model.matmul_dtype` (`linear_layers_in`); unchanged when it is '' (float32
    throughout), only its attention switched for 'auto' decided float32. Weight sync's layout is
    the float32 one: take it (`specs_of`) before this."""
    resolved = resolve_matmul_dtype(matmul_dtype)
    if resolved:
        return linear_layers_in(model, getattr(torch, resolved))
    if matmul_dtype:  # 'auto' decided float32 here: the trainer's attention all the same
        use_float32_attention(model)
    return model


def trainer_autocast(device: torch.device | str, matmul_dtype: str):
    """The autocast the trainer's forward runs under for `model.matmul_dtype` (none for ''):
    what a float32 trainer-held policy evaluates under to compute as the engines do."""
    import contextlib

    matmul_dtype = resolve_matmul_dtype(matmul_dtype)
    if not matmul_dtype:
        return contextlib.nullcontext()
    device_type = device.type if isinstance(device, torch.device) else str(device)
    return torch.autocast(device_type, dtype=getattr(torch, matmul_dtype))


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""x86 CPU flags under which torch's bf16 matmuls run natively (faster than float32)."""

MATMUL_AUTO = "auto"
"""`model.matmul_dtype: auto`: 'bfloat16' where this process computes bf16 natively (a CUDA GPU
with bf16, an x86 CPU with one of `BF16_FLAGS`), '' (float32) elsewhere. Without native bf16,
torch converts around every product: on an AVX2-only CPU a bf16 linear layer of the CPU
default's sizes is 3-11x slower than a float32 one (docs/gpus.md). Decided float32, a run keeps
the float32 attention implementation of bf16 runs (models/attention.py), which computes float32
inputs as they come: the packed training forward and the batched decode attention come with
it."""


def _cpu_flags(cpuinfo: str) -> set[str] | None:
    """The x86 flags Linux's `cpuinfo` lists; None where it lists none (another OS or
    architecture)."""
    try:
        with open(cpuinfo, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    return flags if "sse2" in flags else None


def cpu_lacks_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True on an x86 CPU whose flags (Linux's `cpuinfo`) name no native bf16 instructions,
    where bf16 matmuls are converted to float32 around each product and can be slower than
    float32 ones; False where they are native or it cannot tell (another OS or architecture)."""
    flags = _cpu_flags(cpuinfo)
    return flags is not None and not flags.intersection(BF16_FLAGS)


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True only on an x86 CPU whose flags name native bf16 instructions (where it cannot tell,
    False: float32 is never the slow choice)."""
    flags = _cpu_flags(cpuinfo)
    return flags is not None and bool(flags.intersection(BF16_FLAGS))


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether this process computes bf16 natively: on its CUDA GPU when it has one (the roles
    compute there), otherwise on its CPU."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    return cpu_has_native_bf16()


def resolve_matmul_dtype(value: str) -> str:
    """`model.matmul_dtype` as this process computes it: 'auto' becomes 'bfloat16' or '' by
    `native_bf16`; any other value is returned as it is."""
    if value != MATMUL_AUTO:
        return value
    return "bfloat16" if native_bf16() else ""


def bucket_length(n: int) -> int:
    """`n` rounded up to 8 steps an octave (at most 1/8 more). On a CPU, oneDNN compiles a bf16
    kernel for each new matrix dimension (docs/operations.md), so the sizes that change from step
    to step are rounded to these: the trainer's packed response row (8-10 compiles a step on the
    CPU default with exact lengths, 1-2 with these), its LM head's token count and prompt count
    (train/), and the torch engine's decode batch (rollout/torch_engine.py)."""
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step
