"""Megatron-core train backend: the TrainBackend protocol over a tensor/expert-parallel GPTModel.

Parts: `model` builds the process groups, GPTModel (TransformerEngine layer spec when installed,
else the local spec; `config.fit_to_layer_spec` turns sequence parallel off on the local spec),
DDP and the (distributed) Adam optimizer; `checkpoint` reads HF tensors lazily and `weights`
loads each rank's shards from them and streams full tensors back to rank 0; `convert` maps
Megatron -> HF names; `train/data_parallel.py` (shared with FSDP2) splits a step's
micro-batches over data-parallel ranks; `logprobs` turns vocab-parallel logits into log-probs
and entropy; `replay` routes each micro-batch's MoE tokens to the experts its rows recorded
(routing_replay). One process per GPU
(torchrun); every rank calls every method in the same order with the same micro-batches, and
data-parallel rank r runs micro-batches r, r + W, ... of them (gradients summed over ranks).

Limits: pipeline parallel (pp) and context parallel (cp) must be 1 (NotImplementedError otherwise);
the LM head runs over all positions (the torch backend runs it only at response positions).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any

import torch

from relax_core.train.backend import MicroBatchLoss
from relax_core.train.batch import MicroBatch
from relax_core.train.data_parallel import (
    broadcast_owned,
    dp_share,
    sum_over_group,
    zero_weighted,
)
from relax_core.train.megatron.assemble import ReadHF
from relax_core.train.megatron.checkpoint import SafetensorsCheckpoint, state_reader
from relax_core.train.megatron.config import MegatronParallel, fit_to_layer_spec
from relax_core.train.megatron.convert import megatron_to_hf_named
from relax_core.train.megatron.logprobs import vocab_parallel_logprobs
from relax_core.train.megatron.model import (
    build_gpt,
    build_optimizer,
    init_parallel,
    resolve_spec,
    wrap_ddp,
)
from relax_core.train.megatron.names import Dims
from relax_core.train.megatron.replay import (
    check_no_recompute,
    replaying,
    router_replays,
    router_topk_indices,
)
from relax_core.train.megatron.weights import (
    full_param_layout,
    load_into,
    stream_full_params,
    write_safetensors,
)

log = logging.getLogger(__name__)

DIST_CHECKPOINT_DIR = "megatron"
"""Subdirectory of a checkpoint holding the sharded (dist_checkpointing) model and optimizer."""


class MegatronBackend:
    def __init__(
        self,
        hf_config: Any,
        weights: Mapping[str, torch.Tensor] | ReadHF,
        parallel: MegatronParallel,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        warmup_steps: int = 0,
        dtype: str = "bfloat16",
        spec: str = "auto",
        max_sequence_length: int | None = None,
        seed: int = 0,
        routing_replay: bool = False,
        moe_aux_loss_coeff: float = 0.0,
    ) -> None:
        """`weights`: an HF state dict, or a reader of HF tensors by name (checkpoint.py) from
        which each rank reads only what its shards are made of. `moe_aux_loss_coeff`: the MoE
        router's load-balancing loss, 0 for RL (config.transformer_config_kwargs says why)."""
        for field, size in (("pp", parallel.pp), ("cp", parallel.cp)):
            if size != 1:
                raise NotImplementedError(
                    f"MegatronParallel.{field}={size}: the Megatron backend supports only "
                    f"{field}=1 (use tp/ep to split the model)"
                )
        parallel.check_model(hf_config)
        self.spec = resolve_spec(spec)
        parallel, note = fit_to_layer_spec(parallel, self.spec, hf_config)
        if note:
            log.warning(note)
        init_parallel(parallel, seed)
        self.hf_config = hf_config
        self.parallel = parallel
        self.lr, self.warmup_steps, self.temperature = lr, warmup_steps, temperature
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.routing_replay = routing_replay
        """Route every micro-batch's MoE tokens to its `routed_experts` (rollout routing replay)."""
        self.model, config = build_gpt(
            hf_config,
            parallel,
            dtype,
            self.spec,
            max_sequence_length,
            routing_replay=routing_replay,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
        )
        self._replays = self._router_replays(config) if routing_replay else []
        self.model.to(self.device)
        read = weights if callable(weights) else state_reader(weights)
        load_into(self.model, read, hf_config, self.spec)
        self.ddp = wrap_ddp(self.model, config, parallel)
        self.optimizer = build_optimizer(self.ddp, lr, weight_decay, grad_clip, dtype, parallel)
        self.steps = 0
        """Optimizer steps taken (drives the warmup; saved in checkpoints)."""

    def _router_replays(self, config: Any) -> list[Any]:
        """The model's RouterReplay per MoE layer, checked against the HF config."""
        check_no_recompute(config)
        replays = router_replays(self.model)
        moe_layers = sum(Dims.from_hf(self.hf_config).moe_layers)
        if len(replays) != moe_layers:
            raise RuntimeError(
                f"routing replay: GPTModel has {len(replays)} router replays for "
                f"{moe_layers} MoE layers"
            )
        return replays

    def _data_parallel(self) -> tuple[Any, int, int]:
        """(group, size, this rank's index) of the data-parallel group."""
        from megatron.core import parallel_state as ps

        return (
            ps.get_data_parallel_group(),
            ps.get_data_parallel_world_size(),
            ps.get_data_parallel_rank(),
        )

    def _forward(self, module: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, ...]:
        ids = mb.input_ids.to(self.device)
        # Sequence parallel splits the sequence over TP ranks; right padding changes nothing
        # before it under causal attention.
        ids = torch.nn.functional.pad(
            ids, (0, self.parallel.padded_length(ids.shape[1]) - ids.shape[1])
        )
        positions = torch.arange(ids.shape[1], device=self.device).expand_as(ids)
        # Rows are right-padded and attention is causal: no mask needed for real tokens.
        logits = module(ids, positions, None)  # [B, S, V/tp]
        index = mb.response_positions.to(self.device)
        picked = logits.gather(1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
        return vocab_parallel_logprobs(picked, mb.response_ids.to(self.device), self.temperature)

    def _routing(self, mb: MicroBatch) -> AbstractContextManager[None]:
        """Where the forward (and backward) of `mb` runs: its recorded experts replayed when
        routing_replay is on."""
        if mb.routed_experts is None:
            if self.routing_replay:
                raise ValueError(
                    "routing_replay is on but the micro-batch has no routed_experts (the "
                    "rollout engine must return them)"
                )
            return contextlib.nullcontext()
        if not self.routing_replay:
            raise ValueError(
                "the micro-batch carries routed_experts but the Megatron backend was built "
                "without routing_replay"
            )
        from megatron.core import parallel_state

        indices = router_topk_indices(
            mb.routed_experts.cpu(),  # checked on the host: no device syncs
            tuple(mb.input_ids.shape),
            Dims.from_hf(self.hf_config),
            int(self.hf_config.num_experts_per_tok),
            self.parallel,
            parallel_state.get_tensor_model_parallel_rank(),
        )
        return replaying(self._replays, [layer.to(self.device) for layer in indices])

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Each data-parallel rank scores its share; every rank returns all (on the CPU)."""
        group, size, rank = self._data_parallel()
        share = dp_share(len(micro_batches), rank, size)
        self.model.eval()
        try:
            mine = {i: self._score(micro_batches[i]) for i in share.indices}
            for _ in range(share.padding):  # pairs the MoE all-to-alls with the other ranks
                self._score(micro_batches[0])
        finally:
            self.model.train()

        def empty(mb: MicroBatch) -> torch.Tensor:
            return torch.empty(tuple(mb.response_ids.shape), device=self.device)

        return [t.cpu() for t in broadcast_owned(micro_batches, mine, group, size, empty)]

    def _score(self, mb: MicroBatch) -> torch.Tensor:
        with self._routing(mb):
            return self._forward(self.model, mb)[0].float().contiguous()

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: MicroBatchLoss
    ) -> dict[str, float]:
        """Data-parallel rank r runs micro-batches r, r + W, ... (train/data_parallel.py); the loss
        is each micro-batch's share of the step loss, so the summed gradients are the step's."""
        from megatron.core.distributed import finalize_model_grads

        group, size, rank = self._data_parallel()
        share = dp_share(len(micro_batches), rank, size)
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        total_seqs = sum(mb.num_seqs for mb in micro_batches)
        runs = [(micro_batches[i], loss_fn) for i in share.indices]
        runs += [(micro_batches[0], zero_weighted(loss_fn))] * share.padding
        sums: dict[str, float] = {}
        for mb, fn in runs:
            on_device = _to_device(mb, self.device)
            with self._routing(on_device):  # backward runs no router (no recomputation)
                logprobs, entropy = self._forward(self.ddp, on_device)
                loss, metrics = fn(logprobs, entropy, on_device)
                loss.backward()
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * mb.num_seqs / total_seqs
        finalize_model_grads([self.ddp])
        sums = sum_over_group(sums, group, self.device)
        self._set_lr()
        updated, grad_norm, _ = self.optimizer.step()
        if updated:
            self.steps += 1
        sums["grad_norm"] = float(grad_norm) if grad_norm is not None else math.nan
        sums["lr"] = self._lr()
        sums["skipped_step"] = 0.0 if updated else 1.0
        return sums

    def _lr(self) -> float:
        scale = min(1.0, (self.steps + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        return self.lr * scale

    def _set_lr(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self._lr()

    def named_weights(self, fused_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full tensors on rank 0, one parameter at a time (gathered over TP/EP for that
        parameter only), in `weight_layout`'s order; the other ranks yield nothing but must
        drain the iterator too (they take part in the gathers). Expert layouts: convert.py
        (per-expert names by default; fused_experts=True: transformers 5's 3-D tensors, each
        yielded once every expert of its layer has passed)."""
        yield from megatron_to_hf_named(
            stream_full_params(self.model, self.hf_config), self.hf_config, fused_experts
        )

    def weight_layout(self, fused_experts: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """What `named_weights(fused_experts)` yields, as meta tensors (name, shape, dtype, same
        order), on any rank and without collectives: the weight sync's layout
        (`sync.buckets.specs_of(backend.weight_layout(...))`)."""
        yield from megatron_to_hf_named(
            full_param_layout(self.model, self.hf_config), self.hf_config, fused_experts
        )

    def save_hf(self, directory: str, shard_bytes: int = 5 * 2**30) -> None:
        """HF-format export: config.json and safetensors shards with HF names, written by rank 0."""
        write = _rank() == 0
        if write:
            os.makedirs(directory, exist_ok=True)
            self.hf_config.save_pretrained(directory)
        write_safetensors(self.named_weights(), directory, write, shard_bytes)

    def save(self, directory: str) -> None:
        """HF weights (for rollout engines and evaluation) plus a sharded Megatron checkpoint of
        model and optimizer under `megatron/` (what `load` restores)."""
        from megatron.core import dist_checkpointing

        self.save_hf(directory)
        path = os.path.join(directory, DIST_CHECKPOINT_DIR)
        if _rank() == 0:
            os.makedirs(path, exist_ok=True)
        _barrier()
        dist_checkpointing.save(self._sharded_state(is_loading=False), path)

    def load(self, directory: str) -> None:
        from megatron.core import dist_checkpointing

        path = os.path.join(directory, DIST_CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{directory} has no Megatron checkpoint ({path} missing)")
        state = dist_checkpointing.load(self._sharded_state(is_loading=True), path)
        result = self.model.load_state_dict(state["model"], strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing:
            raise ValueError(f"checkpoint {path} lacks model tensors, e.g. {missing[:3]}")
        # The optimizer copies the saved values into its main parameters, leaves that
        # require grad: outside autograd, as every in-place write into a parameter.
        with torch.no_grad():
            self.optimizer.load_state_dict(state["optimizer"])
        self.steps = int(state["steps"])

    def _sharded_state(self, is_loading: bool) -> dict[str, Any]:
        from megatron.core import parallel_state

        metadata: dict[str, Any] = {
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)
        }
        model_state = self.model.sharded_state_dict(metadata=metadata)
        if self.parallel.distributed_optimizer:
            metadata = {**metadata, "distrib_optim_sharding_type": "dp_reshardable"}
        optimizer_state = self.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=metadata
        )
        return {"model": model_state, "optimizer": optimizer_state, "steps": self.steps}


def _to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    return dataclasses.replace(
        mb,
        input_ids=mb.input_ids.to(device),
        attention_mask=mb.attention_mask.to(device),
        response_ids=mb.response_ids.to(device),
        response_positions=mb.response_positions.to(device),
        loss_mask=mb.loss_mask.to(device),
        extras={k: v.to(device) for k, v in mb.extras.items()},
    )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def build_megatron_backend(
    source: Any,
    train: Any,
    temperature: float,
    parallel: MegatronParallel,
    dtype: str = "bfloat16",
    routing_replay: bool = False,
    moe_aux_loss_coeff: float = 0.0,
) -> MegatronBackend:
    """The Megatron backend under the run's `train` settings (a TrainConfig). `source`: a policy
    directory (config.json and safetensors; each rank reads only what its shards are made of,
    so no rank needs the HF model) or an HF model already in memory. `routing_replay` replays
    each micro-batch's routed experts in the MoE routers."""
    if isinstance(source, (str, os.PathLike)):
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(os.fspath(source))
        weights: Any = SafetensorsCheckpoint(os.fspath(source))
    else:
        hf_config, weights = source.config, state_reader(source.state_dict())
    backend = MegatronBackend(
        hf_config,
        weights,
        parallel,
        train.lr,
        train.weight_decay,
        train.grad_clip,
        temperature,
        train.warmup_steps,
        dtype=dtype,
        routing_replay=routing_replay,
        moe_aux_loss_coeff=moe_aux_loss_coeff,
    )
    if isinstance(weights, SafetensorsCheckpoint):
        weights.close()
    return backend
