"""Torch train backend: an HF causal LM, AdamW, gradient accumulation over token-budget micro-batches.

Log-probs are computed only at response positions: the decoder runs over the whole sequence (rows
repeating a prompt run it once, their responses packed without padding under float32 attention:
train/shared_prompts.py), but the LM head (the widest matmul for real vocabularies) sees just the
hidden states that predict real response tokens (not a micro-batch's padding, whose log-prob and
entropy are 0). Logits are divided
by the rollout temperature so the trainer scores the distribution the engine sampled from. A
micro-batch with `routed_experts` runs with the policy's routers replaying them
(models/routing_replay.py).

Mixed precision: the model's parameters are the float32 master weights (AdamW and its state in
float32); with a `compute_dtype` (bf16) the forward runs under autocast and `named_weights` and the
saved policy are cast to it, the float32 weights saved beside the optimizer state. Under
`model.matmul_dtype` the forward runs under autocast too, with float32 attention, but engines
receive float32 weights (their linear layers round them as autocast does: models/precision.py).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from relax_core.config import TrainConfig
from relax_core.models.lora import adapter_weights, base_state_dict, is_lora, save_adapter
from relax_core.models.precision import bucket_length
from relax_core.models.routing_replay import attach_routing_replay, routing_of
from relax_core.multimodal.protocol import MultimodalDecoder
from relax_core.train.backend import MASTER_WEIGHTS_FILE, MicroBatchLoss
from relax_core.train.batch import MicroBatch
from relax_core.train.master_weights import load_master_weights, save_master_weights
from relax_core.train.offload import StateOffload
from relax_core.train.recompute import use_activation_checkpointing
from relax_core.train.shared_prompts import runs_shared, shared_prompt_hidden

OPTIMIZER_FILE = "optimizer.pt"


def response_logprobs(
    model: PreTrainedModel, mb: MicroBatch, temperature: float, entropy_grad: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, R], entropy [B, R]) of the response tokens of `mb` under `model`; the
    entropy is a metric only (no graph behind it) unless `entropy_grad`."""
    if mb.routed_experts is None:
        return _response_logprobs(model, mb, temperature, entropy_grad)
    routing = routing_of(model)
    if routing is None:
        raise ValueError(
            f"the micro-batch carries routed_experts but {type(model).__name__} has no routing "
            "replay attached (models/routing_replay.attach_routing_replay)"
        )
    with routing.replay(mb.routed_experts):
        return _response_logprobs(model, mb, temperature, entropy_grad)


def _response_logprobs(
    model: PreTrainedModel, mb: MicroBatch, temperature: float, entropy_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = response_hidden(model, mb)
    real = _real_response_tokens(mb)
    return _token_logprobs(model, hidden, mb.response_ids, real, temperature, entropy_grad)


@torch.no_grad()
def greedy_matches(model: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """[B] bool: whether each row's loss-masked response tokens are all the model's most likely
    next token given what precedes them (teacher forcing). For a row whose whole response is
    trained, that is whether greedy decoding from its prompt gives exactly that response."""
    real = _real_response_tokens(mb)
    hidden = response_hidden(model, mb)
    best = model.get_output_embeddings()(hidden[real]).argmax(-1)
    hit = torch.ones(mb.response_ids.shape, dtype=torch.bool, device=best.device)
    hit = hit.masked_scatter(real, best == mb.response_ids[real])
    return (hit | (mb.loss_mask <= 0)).all(dim=1)


def response_hidden(model: PreTrainedModel, mb: MicroBatch) -> torch.Tensor:
    """[B, R, d]: the decoder's hidden state predicting each response token of `mb`."""
    if mb.media is None and runs_shared(model, mb):
        return shared_prompt_hidden(model, mb)
    if mb.media is not None and isinstance(model, MultimodalDecoder):  # M-RoPE positions
        inputs = model.decoder_inputs(mb.input_ids, mb.attention_mask, mb.media)
        hidden = model.get_decoder()(**inputs, attention_mask=mb.attention_mask).last_hidden_state
    elif mb.media is not None:  # an omni policy: media embeddings over the placeholders
        hidden = model.get_decoder()(
            inputs_embeds=model.embed(mb.input_ids, mb.media), attention_mask=mb.attention_mask
        ).last_hidden_state
    else:
        hidden = model.get_decoder()(
            input_ids=mb.input_ids, attention_mask=mb.attention_mask
        ).last_hidden_state
    index = mb.response_positions.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
    return hidden.gather(1, index)


def _real_response_tokens(mb: MicroBatch) -> torch.Tensor:
    """[B, R] bool: the response tokens each row has (False on padding). Response token t of a
    row is input position response_positions + 1, real where the attention mask is 1."""
    following = mb.response_positions + 1
    width = mb.attention_mask.shape[1]
    inside = following < width
    return inside & (mb.attention_mask.gather(1, following.clamp(max=width - 1)) > 0)


def _token_logprobs(
    model: PreTrainedModel,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    real: torch.Tensor,
    temperature: float,
    entropy_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) [B, R] of `tokens` [B, R] from the hidden states predicting them,
    0 where `real` [B, R] is False. The LM head and the vocabulary-wide softmax run on the real
    tokens only, not on a micro-batch's padding. Without `entropy_grad` the entropy is computed
    outside autograd: its [N, V] probabilities are not kept for a backward that never comes
    (for a 150k vocabulary, 0.6 MB per token)."""
    logits = _lm_head(model, hidden[real]).float()  # [N, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, tokens[real].unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(logp_all.exp() * logp_all).sum(-1)
    padded = torch.zeros(tokens.shape, dtype=logprobs.dtype, device=logprobs.device)
    return padded.masked_scatter(real, logprobs), padded.masked_scatter(real, entropy)


def _lm_head(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head over `hidden` [N, d]. On a CPU, N (the micro-batch's real tokens, new nearly
    every step) is padded with zero rows to `bucket_length(N)`: under bf16 autocast oneDNN
    compiles a kernel per new N for the forward and both backward matmuls, 7-11 ms a step for
    the CPU default's 79-token head against ~1 ms padded. A row's logits do not depend on the
    others, and zero rows add nothing to the head's weight gradient."""
    n = hidden.shape[0]
    if hidden.device.type != "cpu" or bucket_length(n) == n:
        return model.get_output_embeddings()(hidden)
    pad = hidden.new_zeros(bucket_length(n) - n, hidden.shape[1])
    return model.get_output_embeddings()(torch.cat([hidden, pad]))[:n]


class ResponseScorer(torch.nn.Module):
    """`response_logprobs` as a module, so a wrapper that acts around a module's forward (FSDP2
    gathers its root's parameters there) sees the whole scoring pass, LM head included."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, mb: MicroBatch, temperature: float, entropy_grad: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropy = response_logprobs(self.model, mb, temperature, entropy_grad)
        # A [B, R] copy: FSDP2 hooks its root's outputs for backward, which a view would not keep
        # if a loss modified it in place.
        return logprobs.clone(), entropy


def _param_groups(model: torch.nn.Module, lr_scale: Callable[[str], float] | None) -> list[dict]:
    """Trainable parameters grouped by learning-rate multiplier (`lr_scale(name)`, 1.0 without
    one), in first-seen order so the optimizer state of a checkpoint maps back to the same
    parameters."""
    groups: dict[float, list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault(1.0 if lr_scale is None else lr_scale(name), []).append(param)
    return [{"params": params, "lr_scale": scale} for scale, params in groups.items()]


class TorchBackend:
    def __init__(
        self,
        model: PreTrainedModel,
        lr: float,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        temperature: float = 1.0,
        warmup_steps: int = 0,
        lr_scale: Callable[[str], float] | None = None,
        scorer: torch.nn.Module | None = None,
        compute_dtype: torch.dtype | None = None,
        weights_dtype: torch.dtype | None = None,
        entropy_grad: bool = True,
        device: torch.device | None = None,
    ) -> None:
        self.model = model.train()
        self.device = torch.device(device) if device else next(model.parameters()).device
        """Where the policy trains (micro-batches are built on the CPU): where its parameters
        are, or `device` for one built in host memory to be offloaded from the start."""
        self.entropy_grad = entropy_grad
        """Whether the loss differentiates the entropy (an entropy bonus); otherwise the entropy
        the forward returns is a metric, computed outside autograd."""
        master = next(model.parameters()).dtype
        self.weights_dtype = weights_dtype or compute_dtype or master
        """The dtype engines receive and the saved policy is in (`model.dtype`): by default the
        one the forward computes in; float32 under `model.matmul_dtype`."""
        self.autocast = compute_dtype if compute_dtype not in (None, master) else None
        """The dtype the forward computes in when it is not the parameters' own."""
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.grad_clip = grad_clip
        self.temperature = temperature
        # On the CPU, torch's fused kernel: one vectorized pass per tensor, with no temporaries
        # (the CPU default's step 2.4 -> 0.73 ms; foreach=True allocated each op's results for
        # every tensor at once, ~150 page faults a step, tests/integration/test_heap.py). The
        # same update to float32 rounding (2e-8 after 100 steps). Elsewhere, and for sharded
        # (DTensor) parameters, torch's default implementation.
        groups = _param_groups(model, lr_scale)
        on_cpu = self.device.type == "cpu" and all(
            not hasattr(p, "placements") for g in groups for p in g["params"]
        )
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=lr,
            weight_decay=weight_decay,
            betas=(0.9, 0.99),
            **({"fused": True} if on_cpu else {}),
        )
        self.before_micro_batch: Callable[[], None] | None = None
        """Called before each micro-batch's forward (e.g. to take cores other roles freed)."""
        self.before_update: Callable[[], None] | None = None
        """Called before the optimizer changes the weights (e.g. to let a weight push that is
        still reading them finish)."""
        self.scorer: torch.nn.Module = scorer if scorer is not None else ResponseScorer(model)
        """Runs `response_logprobs` over `model` (a sharded backend passes its sharded root)."""
        self.offloading: StateOffload | None = None
        """The host copies of the state `offload` moved (None until the first offload)."""

    def _forward(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if self.autocast is None:
            return self.scorer(mb, self.temperature, self.entropy_grad)
        with torch.autocast(self.device.type, dtype=self.autocast):
            return self.scorer(mb, self.temperature, self.entropy_grad)

    @torch.no_grad()
    def logprobs(self, micro_batches: list[MicroBatch]) -> list[torch.Tensor]:
        return [self._forward(mb.to(self.device))[0] for mb in micro_batches]

    def train_step(
        self, micro_batches: list[MicroBatch], loss_fn: MicroBatchLoss
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        total_seqs = sum(mb.num_seqs for mb in micro_batches)
        metrics = self.accumulate_gradients(micro_batches, loss_fn, total_seqs)
        metrics.update(self.apply_gradients())
        return metrics

    def accumulate_gradients(
        self, micro_batches: list[MicroBatch], loss_fn: MicroBatchLoss, total_seqs: int
    ) -> dict[str, float]:
        """Forward and backward of each micro-batch, adding into the gradients. Returns the
        loss metrics weighted by rows out of `total_seqs` (the step's rows, which may be more
        than these micro-batches hold)."""
        sums: dict[str, float] = {}
        for mb in micro_batches:
            if self.before_micro_batch is not None:
                self.before_micro_batch()
            mb = mb.to(self.device)
            logprobs, entropy = self._forward(mb)
            loss, metrics = loss_fn(logprobs, entropy, mb)
            loss.backward()
            # Metrics are per-micro-batch means; weight them by rows to report the batch mean.
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + float(value) * mb.num_seqs / total_seqs
        return sums

    def apply_gradients(self) -> dict[str, float]:
        """Clip the accumulated gradients, warm up the learning rate and step the optimizer (a
        non-finite gradient norm skips the step)."""
        if self.before_update is not None:
            self.before_update()
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.grad_clip if self.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        if math.isfinite(grad_norm):
            self._set_lr()
            self.optimizer.step()
        first = self.optimizer.param_groups[0]
        return {
            "grad_norm": grad_norm,
            "lr": first["lr"] / first["lr_scale"],
            "skipped_step": 0.0 if math.isfinite(grad_norm) else 1.0,
        }

    def _set_lr(self) -> None:
        """Linear warmup keyed on the optimizer's own step count, so it survives a resume."""
        state = next(iter(self.optimizer.state.values()), None)
        done = int(state["step"]) if state else 0
        scale = min(1.0, (done + 1) / self.warmup_steps) if self.warmup_steps else 1.0
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr * scale * group["lr_scale"]

    def offload(self, weights: bool = True) -> None:
        """Give the device back between phases (train.offload_between_steps): gradients
        dropped, optimizer state and with `weights` the trainable parameters in host memory
        (train/offload.py) until `reload`."""
        if self.offloading is None:
            self.offloading = StateOffload(self.model, self.optimizer, self.device)
        self.offloading.offload(weights)

    def reload(self) -> None:
        """What `offload` moved, back on the device, for the next step."""
        if self.offloading is not None:
            self.offloading.reload()

    def _on_host(self) -> contextlib.AbstractContextManager:
        """Offloaded state read and written in host memory (a checkpoint saved or loaded)."""
        return self.offloading.on_host() if self.offloading else contextlib.nullcontext()

    @property
    def keeps_master(self) -> bool:
        """Whether the parameters are wider than what engines receive (float32 master weights)."""
        return self.weights_dtype != next(self.model.parameters()).dtype

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights engines take: a LoRA policy's adapter (float32, as the engines hold
        it), else every parameter in `weights_dtype`."""
        if self.offloading is not None and self.offloading.params:
            raise RuntimeError("named_weights while the weights are offloaded: reload() first")
        if is_lora(self.model):
            yield from adapter_weights(self.model)
            return
        for name, param in self.model.named_parameters():
            yield name, param.detach().to(self.weights_dtype)

    def save(self, directory: str) -> None:
        """The policy in `weights_dtype` (safetensors, what engines and evaluation load), the
        optimizer state and, with master weights, those in float32. A LoRA policy: its frozen
        base under plain HF names and the adapter in PEFT's format (models/lora.py)."""
        with self._on_host():
            self._save(directory)

    def _save(self, directory: str) -> None:
        if is_lora(self.model):
            base = {k: v.to(self.weights_dtype) for k, v in base_state_dict(self.model).items()}
            self.model.save_pretrained(directory, state_dict=base, safe_serialization=True)
            save_adapter(self.model, directory)
        elif self.keeps_master:
            state = {k: v.to(self.weights_dtype) for k, v in self.model.state_dict().items()}
            self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            save_master_weights(self.model.named_parameters(), directory)
        else:
            self.model.save_pretrained(directory, safe_serialization=True)
        torch.save(self.optimizer.state_dict(), os.path.join(directory, OPTIMIZER_FILE))

    def load(self, directory: str) -> None:
        """Restore optimizer state and master weights; the model was built from the policy (in
        `weights_dtype`) by whoever built it."""
        path = os.path.join(directory, OPTIMIZER_FILE)
        state = torch.load(path, map_location="cpu", weights_only=True)
        with self._on_host():
            self.optimizer.load_state_dict(state)
            if self.keeps_master:
                load_master_weights(self.model, os.path.join(directory, MASTER_WEIGHTS_FILE))


def build_backend(
    model: PreTrainedModel,
    train: TrainConfig,
    temperature: float,
    compute_dtype: torch.dtype | None = None,
    weights_dtype: torch.dtype | None = None,
    entropy_grad: bool = True,
    activation_checkpointing: bool = False,
    device: torch.device | None = None,
) -> TorchBackend:
    """The trainer's backend for `model` (float32 master weights when `compute_dtype` is
    narrower, unless `weights_dtype` keeps what engines receive float32) under the run's
    `train` settings; `entropy_grad`: the loss has an entropy term; `activation_checkpointing`:
    train.activation_checkpointing as the memory plan resolved it (plan.trainer_checkpointing);
    `device`: where a policy built in host memory trains (TorchBackend)."""
    if train.routing_replay:
        attach_routing_replay(model)
    if activation_checkpointing:
        use_activation_checkpointing(model)
    encoders = getattr(model, "is_encoder_parameter", None)
    scale = None
    if encoders is not None and train.encoder_lr_scale != 1.0:
        scale = lambda name: train.encoder_lr_scale if encoders(name) else 1.0  # noqa: E731
    return TorchBackend(
        model,
        train.lr,
        train.weight_decay,
        train.grad_clip,
        temperature,
        train.warmup_steps,
        lr_scale=scale,
        compute_dtype=compute_dtype,
        weights_dtype=weights_dtype,
        entropy_grad=entropy_grad,
        device=device,
    )
