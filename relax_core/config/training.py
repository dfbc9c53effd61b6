"""The trainer's sections of a run config: its settings, parallelism and LoRA adapters."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParallelConfig:
    """train.backend 'megatron' (and 'fsdp': data parallel only): how the trainer's GPUs split
    the policy. services.trainer_gpus = tensor x pipeline x context x data parallel."""

    tensor: int = 1
    """Tensor-parallel size (attention heads and MLP columns split across GPUs)."""
    pipeline: int = 1
    """Pipeline-parallel size (layers split into stages)."""
    context: int = 1
    """Context-parallel size (long sequences split across GPUs)."""
    expert: int = 1
    """Expert-parallel size of an MoE policy (experts split across GPUs)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism with tensor parallel (activations sharded between TP ops).
    Needs TransformerEngine's layer spec, which the trainer image lacks: on megatron-core's
    local spec the backend turns it off and says so in the log."""
    distributed_optimizer: bool = True
    """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer)."""


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 0
    """LoRA rank r (0 = off: train every weight)."""
    alpha: float = 16.0
    """LoRA alpha; the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training."""
    target_modules: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated names of the linear layers that get an adapter (the policy's own module
    names; these are Qwen/Llama's attention and MLP projections)."""


@dataclass(frozen=True)
class TrainConfig:
    total_steps: int = 100
    """Optimizer steps of RL (the final policy version)."""
    lr: float = 1e-3
    """AdamW learning rate."""
    encoder_lr_scale: float = 1.0
    """Learning-rate multiplier for an omni policy's media encoders, which start untrained while
    the LM is warm-started (1 = the LM's rate)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over the first N optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global grad norm (0 = no clipping)."""
    minibatches_per_step: int = 1
    """PPO-style updates per step batch: split into this many mini-batches of whole groups, each
    one clipped optimizer update against the log-probs the batch was generated with."""
    micro_batch_tokens: int = 16384
    """Token budget of one forward/backward micro-batch (gradients accumulate across them)."""
    activation_checkpointing: str = "auto"
    """'on': each decoder layer keeps only its input and recomputes the rest in backward (torch
    and fsdp: HF gradient checkpointing; megatron: full recompute); 'off'; 'auto': on where the
    memory plan says the micro-batch's activations would not fit without it (off on a CPU)."""
    offload_between_steps: str = "auto"
    """'on': in colocate mode the trainer's parameters and optimizer state wait in host memory
    while the engine generates (gradients dropped) and come back for the next step (torch
    backend); 'off'; 'auto': on for a colocate run on a GPU, where trainer and engine share it."""
    skip_inert_groups: bool = True
    """Train without groups whose advantages are all 0 (docs/algorithms.md): same update."""
    checkpoint_every: int = 25
    """Save a resumable checkpoint every N steps (and always at the end)."""
    keep_checkpoints: int = 2
    """How many recent checkpoints to keep on disk."""
    eval_every: int = 0
    """Also run the held-out eval every N steps (0 = only at step 0 and at the end)."""
    steps_per_node: int = 50
    """RL steps per Flyte node; the workflow recurses with a checkpoint between nodes."""
    torch_threads: int = 0
    """torch intra-op threads (0 = torch's default)."""
    deterministic: bool = False
    """Repeat bit for bit on the same machine (docs/operations.md#reproducibility): torch's
    deterministic kernels, and the async trainer on a fixed thread count (services.trainer_threads,
    else every usable core) instead of the cores other roles leave idle."""
    backend: str = "torch"
    """'torch' (one process, transformers + AdamW: the CPU default), 'fsdp' (the same, sharded
    with FSDP2 over services.trainer_gpus) or 'megatron' (Megatron-core: TP/PP/CP/EP,
    distributed optimizer; the GPU image)."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the trainer's GPUs split the policy (backend 'megatron'; 'fsdp' is data parallel)."""
    routing_replay: bool = False
    """R3 for an MoE policy: the trainer's routers use the experts the rollout engine chose."""
    moe_aux_loss_coef: float = 0.0
    """MoE router load-balancing loss coefficient (Megatron backend); 0 keeps the policy
    gradient the RL loss's alone (pretraining used ~1e-3)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Train low-rank adapters on a frozen policy instead of every weight (rank > 0): the
    optimizer holds the adapters only, and weight sync moves only them."""
