"""Packing queue rows into padded token tensors and token-budget micro-batches. Pure functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import torch


@dataclass(frozen=True)
class SharedPrompts:
    """The distinct prompts of a micro-batch whose rows repeat them (a GRPO group's samples):
    the prompt runs through the model once and its keys/values serve every row of it.

    ids/mask: [G, P] left-padded distinct prompts; row: [B] which of them each row continues;
    response_mask: [B, R] the rows' real response tokens (loss-masked ones included).
    """

    ids: torch.Tensor
    mask: torch.Tensor
    row: torch.Tensor
    response_mask: torch.Tensor

    def to(self, device: torch.device) -> SharedPrompts:
        return SharedPrompts(*(t.to(device, non_blocking=True) for t in dataclasses.astuple(self)))


@dataclass(frozen=True)
class MicroBatch:
    """Prompt+response sequences, right-padded, and per-response-token tensors.

    input_ids/attention_mask: [B, S]; response_ids/loss_mask: [B, R]; response_positions: [B, R]
    index into S of the hidden state that predicts each response token (prompt_len - 1 + t).
    `extras` holds further [B, R] float tensors (advantages, old/ref/rollout log-probs); `media`
    each row's encoded media inputs for an omni policy (models/omni.py), None for text.
    `routed_experts` [B, S, num_layers * top_k] long: the experts the rollout engine routed each
    input token to (routing replay, models/routing_replay.py); positions it has none for (a
    row's last token, padding) hold expert 0, which no response log-prob depends on.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_ids: torch.Tensor
    response_positions: torch.Tensor
    loss_mask: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    media: list | None = None
    routed_experts: torch.Tensor | None = None
    shared: SharedPrompts | None = None
    """Set when rows repeat prompts (text rows): a backend may run each prompt once."""

    @property
    def num_seqs(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with its tensors on `device` (itself when they are there).
        Media inputs stay where their encoder's resolver put them."""
        if self.input_ids.device == torch.device(device):
            return self
        moved = {
            f.name: value.to(device, non_blocking=True)
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), torch.Tensor)
        }
        extras = {k: v.to(device, non_blocking=True) for k, v in self.extras.items()}
        shared = None if self.shared is None else self.shared.to(device)
        return dataclasses.replace(self, **moved, extras=extras, shared=shared)


def pad_2d(rows: Sequence[Sequence[float]], width: int, value: float, dtype: torch.dtype):
    """[len(rows), width] tensor, each row left-aligned and padded with `value`. One tensor is
    built from all rows' values at once (a tensor per row costs more than the values)."""
    out = torch.full((len(rows), width), value, dtype=dtype)
    lengths = torch.tensor([len(row) for row in rows], dtype=torch.long)
    total = int(lengths.sum())
    if total:
        flat = torch.tensor(list(chain.from_iterable(rows)), dtype=dtype)
        row_of = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        starts = torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
        out[row_of, torch.arange(total) - starts] = flat
    return out


def make_micro_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[int]],
    pad_token_id: int,
    extras: dict[str, Sequence[Sequence[float]]] | None = None,
    routed_experts: Sequence[Sequence[Sequence[int]]] | None = None,
    share_prompts: bool = False,
) -> MicroBatch:
    if not prompt_ids:
        raise ValueError("cannot build a micro-batch from zero rows")
    seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    width = max(len(s) for s in seqs)
    r_width = max(1, max(len(r) for r in response_ids))
    input_ids = pad_2d(seqs, width, pad_token_id, torch.long)
    attention = pad_2d([[1] * len(s) for s in seqs], width, 0, torch.long)
    prompt_len = torch.tensor([len(p) for p in prompt_ids])
    positions = (prompt_len.unsqueeze(1) - 1 + torch.arange(r_width)).clamp(max=width - 1)
    resp = pad_2d(response_ids, r_width, pad_token_id, torch.long)
    mask = pad_2d(loss_mask, r_width, 0, torch.float32)
    ext = {k: pad_2d(v, r_width, 0.0, torch.float32) for k, v in (extras or {}).items()}
    experts = None if routed_experts is None else _experts_tensor(routed_experts, seqs, width)
    shared = None
    if share_prompts and experts is None:
        shared = shared_prompts(prompt_ids, response_ids, pad_token_id, r_width)
    return MicroBatch(
        input_ids, attention, resp, positions, mask, ext, routed_experts=experts, shared=shared
    )


def shared_prompts(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    pad_token_id: int,
    r_width: int,
) -> SharedPrompts | None:
    """The distinct prompts among the rows (first-seen order), or None when none repeats."""
    index: dict[tuple[int, ...], int] = {}
    row = [index.setdefault(tuple(p), len(index)) for p in prompt_ids]
    if len(index) == len(row):
        return None
    distinct = list(index)
    width = max(len(p) for p in distinct)
    ids = torch.full((len(distinct), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for g, p in enumerate(distinct):
        ids[g, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        mask[g, width - len(p) :] = 1
    lengths = torch.tensor([len(r) for r in response_ids])
    response_mask = (torch.arange(r_width) < lengths.unsqueeze(1)).long()
    return SharedPrompts(ids, mask, torch.tensor(row), response_mask)


def _experts_tensor(
    rows: Sequence[Sequence[Sequence[int]]], seqs: list[list[int]], width: int
) -> torch.Tensor:
    """[B, width, num_layers * top_k] long, each row's experts from its first token on."""
    per_token = {len(tokens[0]) for tokens in rows if len(tokens)}
    if len(per_token) > 1:
        raise ValueError(f"routed_experts: rows differ in experts per token ({sorted(per_token)})")
    out = torch.zeros((len(rows), width, per_token.pop() if per_token else 0), dtype=torch.long)
    for i, (tokens, seq) in enumerate(zip(rows, seqs, strict=True)):
        if len(tokens) > len(seq):
            raise ValueError(
                f"routed_experts: row {i} has experts for {len(tokens)} tokens, its sequence "
                f"{len(seq)}"
            )
        if len(tokens):
            out[i, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    return out


def split_by_token_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group row indices so that rows x longest-row-length stays within `budget` tokens.

    Rows are taken longest first so similar lengths share a micro-batch (less padding). A row
    longer than the budget gets a micro-batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        longest_if_added = max(longest, lengths[i])
        if current and longest_if_added * (len(current) + 1) > budget:
            groups.append(current)
            current, longest_if_added = [], lengths[i]
        current.append(i)
        longest = longest_if_added
    if current:
        groups.append(current)
    return groups
