"""Supervised warm start: a few steps of next-token loss on prompt -> response, so RL begins from a
policy that is sometimes right. Reuses the torch backend with a cross-entropy micro-batch loss
over the tokens each example's loss_mask marks (a multi-turn demonstration's model turns, never
its observations)."""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import Iterator
from typing import Any

import torch

from relax_core.train.batch import MicroBatch, make_micro_batch
from relax_core.train.torch_backend import TorchBackend, greedy_matches

Example = tuple[list[int], list[int], list[int]]
"""(prompt_ids, response_ids, loss_mask): one supervised example."""


def _ce_loss(logprobs: torch.Tensor, entropy: torch.Tensor, mb: MicroBatch):
    loss = -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1)
    return loss, {"sft_loss": loss.detach()}


def answer_example(tokenizer: Any, prompt_ids: list[int], answer: str) -> Example:
    """A single-turn example: the answer's tokens and EOS, all trained."""
    return answer_examples(tokenizer, [prompt_ids], [answer])[0]


def answer_examples(
    tokenizer: Any, prompt_ids: list[list[int]], answers: list[str]
) -> list[Example]:
    """`answer_example` of each (prompt, answer), the answers tokenized in one call (a
    dataset's thousands of calls one by one cost the warm start about half a second)."""
    if not answers:
        return []
    eos = tokenizer.eos_token_id
    encoded = tokenizer(list(answers), add_special_tokens=False)["input_ids"]
    out = []
    for ids, answer_ids in zip(prompt_ids, encoded, strict=True):
        response = [*answer_ids, eos]
        out.append((ids, response, [1] * len(response)))
    return out


PROBE_SIZE = 256
"""Most examples a warm start with a target accuracy holds out to check it on."""
CHECK_EVERY = 10
"""Steps between two checks of the target accuracy."""


@dataclasses.dataclass(frozen=True)
class WarmStartResult:
    losses: list[float]
    """The supervised loss of each step taken."""
    probe_accuracy: float | None = None
    """The probe's share answered right when the warm start ended (None without a target)."""

    @property
    def steps(self) -> int:
        return len(self.losses)


def warm_start(
    model: Any,
    tokenizer: Any,
    examples: list[Example],
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    media: list | None = None,
    target_accuracy: float = 0.0,
    matmul_dtype: torch.dtype | None = None,
    target_per_length: bool = False,
) -> WarmStartResult:
    """Train `model` in place on (prompt_ids, response_ids, loss_mask) examples, `steps` steps
    or, with a `target_accuracy`, until that share of a held-out probe of the examples has every
    trained token as the model's greedy choice (checked before the first step and every
    CHECK_EVERY steps; `steps` is then the most it takes). `media`: each example's encoder
    inputs (an omni policy), in example order. `matmul_dtype` (a float32 text policy's
    `model.matmul_dtype`): the training forward runs as the RL trainer's does, linear layers in
    it under autocast, attention and the rest in float32; the weights stay float32, and the
    probe is checked in float32. `target_per_length`: the target must hold on each response
    length (trained tokens per example) that makes up a tenth of the probe or more, not only
    on the probe as a whole (probe_accuracy then reports the weakest such length)."""
    if not examples:
        raise ValueError("the warm start has no examples")
    train, probe = _split_probe(examples, media, seed, target_accuracy, tokenizer.pad_token_id)
    attention = float32_attention(model) if matmul_dtype is not None else contextlib.nullcontext()
    with attention:
        backend = TorchBackend(
            model,
            lr=lr,
            grad_clip=1.0,
            compute_dtype=matmul_dtype,
            weights_dtype=torch.float32 if matmul_dtype is not None else None,
        )

        def probe_accuracy() -> float | None:
            if probe is None:
                return None
            hits = greedy_matches(model, probe.to(backend.device)).cpu()
            if not target_per_length:
                return float(hits.float().mean())
            return weakest_length_accuracy(hits, probe.loss_mask.sum(dim=1))

        rng = random.Random(seed)
        losses: list[float] = []
        for step in range(steps):
            if probe is not None and step % CHECK_EVERY == 0:
                accuracy = probe_accuracy()
                if accuracy is not None and accuracy >= target_accuracy:
                    return WarmStartResult(losses, accuracy)
            picks = [train[i] for i in rng.sample(range(len(train)), min(batch_size, len(train)))]
            mb = _batch(examples, media, picks, tokenizer.pad_token_id)
            losses.append(backend.train_step([mb], _ce_loss)["sft_loss"])
        return WarmStartResult(losses, probe_accuracy())


def weakest_length_accuracy(hits: torch.Tensor, lengths: torch.Tensor) -> float:
    """The lowest share of `hits` [B] bool among the rows of one of `lengths` [B] that makes
    up a tenth of the rows or more (the share over all rows when none does)."""
    counts = torch.bincount(lengths.long().cpu())
    common = [n for n in range(len(counts)) if counts[n] * 10 >= len(hits)]
    if not common:
        return float(hits.float().mean())
    return min(float(hits[lengths == n].float().mean()) for n in common)


def _split_probe(
    examples: list[Example], media: list | None, seed: int, target_accuracy: float, pad: int
) -> tuple[list[int], MicroBatch | None]:
    """(the indices the warm start trains on, the held-out probe's batch or None without a
    target accuracy)."""
    train = list(range(len(examples)))
    if target_accuracy <= 0:
        return train, None
    size = min(PROBE_SIZE, len(examples) // 10)
    if size < 1:
        raise ValueError(
            f"warm_start.target_accuracy: {len(examples)} examples are too few to hold out a "
            "probe (10 at least); set it to 0"
        )
    # Its own stream, so the training batches of a seed depend only on the probe's size.
    held = set(random.Random(f"warm-start-probe-{seed}").sample(train, size))
    return [i for i in train if i not in held], _batch(examples, media, sorted(held), pad)


@contextlib.contextmanager
def float32_attention(model: Any) -> Iterator[None]:
    """`model` with the float32 attention of models/attention.py inside the block, its own
    implementation again afterwards (what a saved policy's config names)."""
    from relax_core.models.attention import use_float32_attention

    before = model.config._attn_implementation
    use_float32_attention(model)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


def _batch(examples: list[Example], media: list | None, picks: list[int], pad: int) -> MicroBatch:
    mb = make_micro_batch(
        [examples[i][0] for i in picks],
        [examples[i][1] for i in picks],
        [examples[i][2] for i in picks],
        pad,
    )
    if media is not None:
        mb = dataclasses.replace(mb, media=[media[i] for i in picks])
    return mb
