"""FSDP2 train backend: the torch backend's math, data parallel over several GPUs (or CPU ranks).

Parameters are sharded per decoder layer with `fully_shard` (DTensor per parameter); the root
FSDP unit is the backend's scoring module (`ResponseScorer`: the HF model plus the response-only
LM head), because the backend's forward goes through `get_decoder()`/`get_output_embeddings()`
rather than `model.forward`, and FSDP2 gathers the root's parameters (embeddings, final norm, LM
head) around the root's forward. Loss, log-probs, clipping, warmup and the optimizer are those of
a `TorchBackend` built on the sharded model; this module only splits a step's micro-batches over
ranks and makes the ranks agree.

Every rank receives the same step (all micro-batches) and calls every method in step with the
others: forwards, `named_weights`, `save` and `load` are collective. The process group is the
caller's (`torch.distributed.init_process_group`: gloo on CPU, nccl on GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from relax_core.config import TrainConfig
from relax_core.models.lora import adapter_weights, is_lora, save_adapter, split_state
from relax_core.train.backend import MASTER_WEIGHTS_FILE, MicroBatchLoss
from relax_core.train.batch import MicroBatch
from relax_core.train.data_parallel import (
    broadcast_owned,
    dp_share,
    sum_over_group,
    zero_weighted,
)
from relax_core.train.master_weights import read_master_weights, save_master_weights
from relax_core.train.torch_backend import ResponseScorer, TorchBackend, build_backend

OPTIMIZER_DIR = "optim"
OPTIMIZER_FILE = "optimizer.pt"
_LAYER_LISTS = ("layers", "h", "blocks")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, each its own FSDP unit: the classes HF names in
    `_no_split_modules` (decoder layers, and a multimodal model's encoder blocks), else a
    ModuleList called layers/h/blocks. Inner blocks come before the blocks holding them."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        found = [
            block
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in _LAYER_LISTS
            for block in m
        ]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers to shard with FSDP2 (no module of a "
            f"class in _no_split_modules, no ModuleList named {'/'.join(_LAYER_LISTS)}); use "
            "train.backend 'torch' for it"
        )
    return found[::-1]  # modules() is parents first; fully_shard wants children first


def shard_policy(
    model: PreTrainedModel, mesh_or_none: DeviceMesh | None, compute_dtype: torch.dtype | None
) -> ResponseScorer:
    """Shard `model` in place with FSDP2: each decoder layer, then the root (the returned scoring
    module that holds `model`). A `compute_dtype` narrower than the parameters (bf16 over float32
    master weights) is FSDP2's mixed precision: parameters all-gathered in it, gradients reduced
    in float32; the sharded parameters (optimizer, master weights) stay in the model's dtype."""
    kwargs: dict = {"mesh": mesh_or_none, "reshard_after_forward": True}
    if compute_dtype is not None and compute_dtype != next(model.parameters()).dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=compute_dtype, reduce_dtype=torch.float32
        )
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    root = ResponseScorer(model)
    fully_shard(root, **kwargs)
    return root


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective on its mesh); plain tensors pass through."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class FSDPBackend:
    """A `TrainBackend` over an FSDP2-sharded model: rank r of W takes micro-batches r, r+W, ...
    of each step (train/data_parallel.py). The loss functions normalise by the whole step's token/sequence counts (each
    micro-batch's loss is its share of the step loss), so gradients are summed across ranks,
    not averaged: W ranks then give the gradient of one process running every micro-batch."""

    def __init__(
        self, inner: TorchBackend, mesh: DeviceMesh, device: torch.device | str = "cpu"
    ) -> None:
        self.inner = inner
        self.model = inner.model
        self.root = inner.scorer
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.world = mesh.size()
        self.device = torch.device(device)
        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM

    @property
    def before_micro_batch(self) -> Callable[[], None] | None:
        return self.inner.before_micro_batch

    @before_micro_batch.setter
    def before_micro_batch(self, hook: Callable[[], None] | None) -> None:
        self.inner.before_micro_batch = hook

    def _to_device(self, mb: MicroBatch) -> MicroBatch:
        return mb.to(self.device)

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Each rank scores its share; every rank returns all of them (broadcast by owner)."""
        mbs = [self._to_device(mb) for mb in micro_batches]
        share = dp_share(len(mbs), self.rank, self.world)
        mine = {i: self.inner._forward(mbs[i])[0] for i in share.indices}
        for _ in range(share.padding):
            self.inner._forward(mbs[0])  # keeps the all-gathers paired across ranks

        def empty(mb: MicroBatch) -> torch.Tensor:
            shape = (mb.num_seqs, mb.response_ids.shape[1])
            return torch.empty(shape, dtype=torch.float32, device=self.device)

        return broadcast_owned(mbs, mine, self.group, self.world, empty)

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: MicroBatchLoss
    ) -> dict[str, float]:
        mbs = [self._to_device(mb) for mb in micro_batches]
        share = dp_share(len(mbs), self.rank, self.world)
        total_seqs = sum(mb.num_seqs for mb in mbs)
        self.inner.optimizer.zero_grad(set_to_none=True)
        mine = [mbs[i] for i in share.indices]
        sums = self.inner.accumulate_gradients(mine, loss_fn, total_seqs)
        if share.padding:
            padding = self.inner.accumulate_gradients(
                mbs[:1] * share.padding, zero_weighted(loss_fn), total_seqs
            )
            sums = {k: sums.get(k, 0.0) + v for k, v in padding.items()}
        metrics = sum_over_group(sums, self.group, self.device)
        metrics.update(self.inner.apply_gradients())  # grad norm: a DTensor reduced over ranks
        return metrics

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights by HF name, in the dtype engines hold; a LoRA policy's
        adapter only (float32). Collective: each tensor is all-gathered, so every rank must
        iterate to the end in step, though only rank 0 (the weight-sync sender) needs them."""
        lora = is_lora(self.model)
        dtype = self.inner.weights_dtype
        for name, param in self.model.named_parameters():
            if not lora:
                yield name, _full(param.detach()).to(dtype)
            elif param.requires_grad:  # a LoRA policy's adapter, float32 as engines hold it
                yield name, _full(param.detach())

    def _full_state_dict(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(state dict in the engines' dtype, float32 master parameters when the model keeps
        them) on rank 0's CPU, ({}, {}) elsewhere. Collective: one tensor gathered at a time."""
        state, master = {}, {}
        params = {id(p) for p in self.model.parameters()}  # tied parameters once, as named
        keep = self.inner.keeps_master
        adapter = {n for n, _ in adapter_weights(self.model)}  # float32 whatever model.dtype
        seen: set[int] = set()
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:  # a tied weight (lm_head = embeddings) is written once
                continue
            seen.add(id(tensor))
            full = _full(tensor.detach())
            if self.rank == 0:
                dtype = torch.float32 if name in adapter else self.inner.weights_dtype
                state[name] = full.to("cpu", dtype)
                if keep and id(tensor) in params:
                    master[name] = full.cpu()
                    params.discard(id(tensor))
        return state, master

    def save(self, directory: str) -> None:
        """Rank 0 writes the HF model (safetensors, as any checkpoint, in the engines' dtype;
        a LoRA policy's frozen base under plain names and its adapter in PEFT's format, as
        `TorchBackend.save`), the full optimizer state (tensors keyed by parameter name;
        `optim/optimizer.pt`) and float32 master weights when kept
        (`optim/master.safetensors`). Collective."""
        state, master = self._full_state_dict()
        optim = get_optimizer_state_dict(
            self.root,
            self.inner.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=True),
        )
        if self.rank == 0 and is_lora(self.model):  # base + adapter, as TorchBackend.save
            state, adapter = split_state(state)
            save_adapter(self.model, directory, adapter)
        if self.rank == 0:
            self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            os.makedirs(os.path.join(directory, OPTIMIZER_DIR), exist_ok=True)
            torch.save(optim, os.path.join(directory, OPTIMIZER_DIR, OPTIMIZER_FILE))
            if master:
                save_master_weights(iter(master.items()), os.path.join(directory, OPTIMIZER_DIR))
        dist.barrier(group=self.group)

    def load(self, directory: str) -> None:
        """Restore the optimizer state and master weights (rank 0 reads, then they are
        scattered to the shards); the model was built from the policy by whoever built it, as
        for `TorchBackend`. Collective."""
        optim: dict = {}
        master: dict[str, torch.Tensor] = {}
        if self.rank == 0:
            path = os.path.join(directory, OPTIMIZER_DIR, OPTIMIZER_FILE)
            optim = torch.load(path, map_location="cpu", weights_only=True)
        if self.inner.keeps_master:
            if self.rank == 0:
                master = read_master_weights(
                    os.path.join(directory, OPTIMIZER_DIR, MASTER_WEIGHTS_FILE),
                    [n for n, _ in self.model.named_parameters()],
                )
            set_model_state_dict(  # the sharded root holds the policy as `model`
                self.root,
                {f"model.{name}": tensor for name, tensor in master.items()},
                options=StateDictOptions(
                    full_state_dict=True, broadcast_from_rank0=True, strict=False
                ),
            )
        set_optimizer_state_dict(
            self.root,
            self.inner.optimizer,
            optim,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )


def build_fsdp_backend(
    model: PreTrainedModel,
    train: TrainConfig,
    temperature: float,
    mesh: DeviceMesh | None = None,
    device: torch.device | str = "cpu",
    compute_dtype: torch.dtype | None = None,
    entropy_grad: bool = True,
    activation_checkpointing: bool = False,
) -> FSDPBackend:
    """The trainer's FSDP2 backend for `model` under the run's `train` settings. Call on every
    rank after `init_process_group` (and `torch.cuda.set_device(local_rank)` on GPU), with the
    same unsharded `model` on each (e.g. loaded from the same checkpoint); `device` is this
    rank's ('cuda:<local_rank>' or 'cpu'); `mesh` defaults to all ranks of the default group;
    `compute_dtype` narrower than `model`'s float32 makes it master weights (mixed precision);
    `entropy_grad`: the loss has an entropy term; `activation_checkpointing`: each decoder layer
    recomputes its activations in backward (train/recompute.py)."""
    device = torch.device(device)
    if mesh is None:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    root = shard_policy(model, mesh, compute_dtype)
    # AdamW over the sharded parameters; FSDP2 (not autocast) computes in compute_dtype
    inner = build_backend(
        model,
        train,
        temperature,
        entropy_grad=entropy_grad,
        activation_checkpointing=activation_checkpointing,
    )
    inner.weights_dtype = compute_dtype or inner.weights_dtype
    inner.scorer = root
    return FSDPBackend(inner, mesh, device)
