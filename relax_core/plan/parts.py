"""The arithmetic of each part of a GPU's memory: bytes from a policy's shape and the run's
settings. Each function returns the parts of one GPU of one process; memory.py sums them.

Trainer (one GPU of it):
- torch backend: float32 master weights, gradients and AdamW state (4 + 4 + 8 bytes a parameter),
  and under bf16 autocast a bf16 copy of every weight, cached for the step.
- fsdp: the same state sharded over the trainer's GPUs; the embeddings and two layers are
  gathered in bf16 at a time.
- megatron: bf16 parameters and float32 gradient buffers split by tensor (and, for experts,
  expert) parallel; the optimizer's float32 main parameters and Adam moments also split over
  data-parallel ranks with the distributed optimizer (experts over expert-data-parallel ranks).
- activations: what autograd keeps per token per layer (coefficients below, from what HF Qwen3
  and megatron-core's local spec save), times ACTIVATION_CALIBRATION; with checkpointing each
  layer keeps its input only and one layer's activations are recomputed at a time.
- logits: torch and fsdp run the LM head on response tokens only, in float32 with its
  log-softmax and the entropy's temporaries (16 bytes per token and vocabulary entry);
  megatron runs it over every position ([B, S, V] bf16) and then picks the response rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from relax_core.plan.shapes import Shape

GIB = 1 << 30

CUDA_CONTEXT = int(1.0 * GIB)
"""Per process and GPU: the CUDA context, cuBLAS workspaces and NCCL buffers (outside what
torch's allocator counts)."""

ACTIVATION_CALIBRATION = 1.31
"""Measured over analytic activations: the torch backend's peak at the Qwen3-0.6B shape on an
H200 (bench/RESULTS.md, 49.7 GiB at 8,192 tokens) less its state and logits, divided by the
coefficients below (what they miss: GQA's repeated keys and values, masks, casts)."""

ENTROPY_LOGITS_BYTES = 16
"""torch/fsdp, per response token and vocabulary entry: float32 logits, their log-softmax, and
exp() and its product for the entropy, alive together at the forward's peak."""

MEGATRON_LOGITS_BYTES = 38
"""megatron, per response token and vocabulary entry (of its tensor-parallel slice): the
picked bf16 rows (2) and nine float32 temporaries of vocab_parallel_logprobs (36)."""


@dataclass(frozen=True)
class Part:
    name: str
    """What the printed plan calls it."""
    bytes: int
    setting: str = ""
    """The setting that changes it (empty: fixed)."""


@dataclass(frozen=True)
class TrainerLayout:
    """How the trainer splits the policy over its GPUs."""

    backend: str
    gpus: int
    tensor: int = 1
    expert: int = 1
    distributed_optimizer: bool = True
    lora: bool = False
    compute_bf16: bool = True
    """The forward computes in a 2-byte dtype (model.dtype bf16/fp16) over float32 masters."""
    weight_bytes: int = 2
    """Bytes a parameter of model.dtype takes (a LoRA run's frozen base is held in it)."""

    @property
    def data_parallel(self) -> int:
        return max(1, self.gpus // self.tensor)

    @property
    def expert_data_parallel(self) -> int:
        return max(1, self.gpus // (self.tensor * self.expert))


def layer_activation_bytes(shape: Shape, backend: str, seq: int, tensor: int = 1) -> float:
    """Bytes autograd keeps per token for one decoder layer (before calibration).

    HF Qwen3 (torch, fsdp): two float32 RMSNorms (8h each), the bf16 casts of the projections'
    inputs (6h + 4h), q/k norms in float32 (8 per element), SDPA's q, k, v, output and o_proj's
    input (4q + 4kv + 2q), SwiGLU's gate, up, act and product (8I). megatron-core's local spec:
    bf16 norms and inputs (12h), q/k/v and outputs (8q + 4kv), the same MLP, and unfused
    attention's softmax probabilities, float32 and bf16 (6 bytes per head and key position).
    """
    h, q, kv = shape.hidden, shape.q_width, shape.kv_width
    if shape.experts:
        mlp = shape.experts_per_token * (2 * h + 8 * shape.expert_intermediate) + 8 * shape.experts
    else:
        mlp = 8 * shape.intermediate
    if backend == "megatron":
        return 12 * h + (8 * q + 4 * kv + mlp + 6 * shape.heads * seq) / tensor
    return 26 * h + 14 * q + 12 * kv + mlp


def activations(shape: Shape, layout: TrainerLayout, tokens: int, seq: int, ckpt: bool) -> int:
    """Activations of one micro-batch of `tokens` tokens (sequences of `seq`)."""
    layer = layer_activation_bytes(shape, layout.backend, seq, layout.tensor)
    if ckpt:  # each layer's input (the residual stream), one layer recomputed at a time
        width = 4 if layout.backend == "torch" else 2
        kept = shape.layers * width * shape.hidden + layer
    else:
        kept = shape.layers * layer
    return int(ACTIVATION_CALIBRATION * kept * tokens)


def logits(shape: Shape, layout: TrainerLayout, tokens: int, response: int) -> int:
    """The LM head's output and what the loss builds on it, for one micro-batch."""
    if layout.backend == "megatron":
        vocab = shape.vocab / layout.tensor
        return int(vocab * (2 * tokens + MEGATRON_LOGITS_BYTES * response))
    return int(shape.vocab * ENTROPY_LOGITS_BYTES * response)


def trainer_state(shape: Shape, layout: TrainerLayout) -> list[Part]:
    """Weights, master weights, gradients and optimizer state on one trainer GPU."""
    if layout.backend == "megatron":
        return _megatron_state(shape, layout)
    n = layout.gpus if layout.backend == "fsdp" else 1
    where = "services.trainer_gpus (fsdp shards it)" if n > 1 else "train.backend fsdp over more "
    where = where if n > 1 else where + "services.trainer_gpus, or train.lora.rank"
    p = shape.params
    if layout.lora:  # a frozen base in model.dtype; the adapters' state is small
        base = Part("policy weights (frozen base, model.dtype)", layout.weight_bytes * p)
        return [base]
    if layout.backend == "fsdp":
        gathered = shape.vocab * shape.hidden * (1 if shape.tied else 2)
        gathered += 2 * (shape.params - gathered) // shape.layers
        compute = Part("policy weights (bf16, gathered: embeddings + 2 layers)", 2 * gathered)
    else:
        compute = Part("policy weights (bf16 autocast copy)", 2 * p, "train.backend fsdp")
    parts = [compute] if layout.compute_bf16 else []
    return parts + [
        Part("master weights (fp32)", 4 * p // n, where),
        Part("gradients (fp32)", 4 * p // n, where),
        Part(f"optimizer state (AdamW, {_sharding(layout)})", 8 * p // n, where),
    ]


def _sharding(layout: TrainerLayout) -> str:
    if layout.backend == "fsdp" and layout.gpus > 1:
        return f"FSDP2 over {layout.gpus} GPUs"
    if layout.backend == "megatron":
        split = f"tp {layout.tensor} ep {layout.expert}"
        if not layout.distributed_optimizer:
            return f"{split}, dp-replicated"
        return f"{split}, dp {layout.data_parallel} / expert dp {layout.expert_data_parallel}"
    return "one GPU, unsharded"


def _megatron_state(shape: Shape, layout: TrainerLayout) -> list[Part]:
    dense = shape.dense_params / layout.tensor
    experts = shape.expert_params / (layout.tensor * layout.expert)
    opt_dense = dense / layout.data_parallel if layout.distributed_optimizer else dense
    opt_experts = experts / layout.expert_data_parallel if layout.distributed_optimizer else experts
    split = "train.parallel.tensor / expert"
    shard = "services.trainer_gpus (data parallel), train.parallel.distributed_optimizer"
    return [
        Part("policy weights (bf16, tp/ep shard)", int(2 * (dense + experts)), split),
        Part("gradients (fp32 buffer)", int(4 * (dense + experts)), split),
        Part("master weights (fp32, optimizer's)", int(4 * (opt_dense + opt_experts)), shard),
        Part(
            f"optimizer state (Adam, {_sharding(layout)})",
            int(8 * (opt_dense + opt_experts)),
            shard,
        ),
    ]


def engine_kv_tokens(shape: Shape, pool: int, weights: int, tensor: int) -> int:
    """Tokens of KV cache a static pool of `pool` bytes holds beside its weights share."""
    per_token = shape.kv_bytes_per_token / tensor
    return max(0, int((pool - weights) / per_token))
