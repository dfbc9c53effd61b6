"""Packing queue rows into padded token tensors and token-budget micro-batches. Pure functions."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import pyarrow as pa
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


@dataclass(frozen=True)
class Ragged:
    """Rows of different lengths as one flat array and row offsets, an Arrow list column's own
    layout: padding any subset of the rows is a few numpy calls, not a loop over Python lists
    (which cost more than the tensor math of a tiny model's step)."""

    values: np.ndarray
    offsets: np.ndarray
    """[rows + 1] int64: row i is values[offsets[i]:offsets[i + 1]]."""

    @classmethod
    def of_lists(cls, rows: Sequence[Sequence[float]], dtype: type) -> Ragged:
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum([len(row) for row in rows], out=offsets[1:])
        flat = np.fromiter(chain.from_iterable(rows), dtype=dtype, count=int(offsets[-1]))
        return cls(flat, offsets)

    @classmethod
    def of_column(cls, column: pa.Array | pa.ChunkedArray) -> Ragged:
        """A list column's rows (a null row is empty); its buffers, not Python lists."""
        if isinstance(column, pa.ChunkedArray):
            column = column.combine_chunks()
        # `offsets` follow a sliced array's offset and index `values`, which ignores it.
        offsets = column.offsets.to_numpy().astype(np.int64)
        return cls(column.values.to_numpy(zero_copy_only=False), offsets)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        return self.offsets[rows + 1] - self.offsets[rows]

    def padded(self, rows: np.ndarray, width: int, value: float, dtype: type) -> np.ndarray:
        """[len(rows), width]: each of `rows` left-aligned, padded with `value`."""
        return self.placed(np.full((len(rows), width), value, dtype=dtype), rows, 0)

    def placed(self, out: np.ndarray, rows: np.ndarray, at: np.ndarray | int) -> np.ndarray:
        """`out` with row k's values written from column `at` (per row, or one for all) on."""
        cols = np.arange(out.shape[1]) - np.asarray(at).reshape(-1, 1)
        keep = (cols >= 0) & (cols < self.lengths(rows)[:, None])
        out[keep] = self.values[(self.offsets[rows][:, None] + cols)[keep]]
        return out


def pad_2d(rows: Sequence[Sequence[float]], width: int, value: float, dtype: torch.dtype):
    """[len(rows), width] tensor, each row left-aligned and padded with `value`."""
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    ragged = Ragged.of_lists(rows, np_dtype)
    return torch.from_numpy(ragged.padded(np.arange(len(rows)), width, value, np_dtype))


def make_micro_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[int]],
    pad_token_id: int,
    extras: dict[str, Sequence[Sequence[float]]] | None = None,
    routed_experts: Sequence[Sequence[Sequence[int]]] | None = None,
    share_prompts: bool = False,
) -> MicroBatch:
    """The micro-batch of these rows (Python lists; `micro_batch` takes Ragged columns)."""
    ints = [Ragged.of_lists(x, np.int64) for x in (prompt_ids, response_ids, loss_mask)]
    floats = {k: Ragged.of_lists(v, np.float32) for k, v in (extras or {}).items()}
    rows = np.arange(len(prompt_ids))
    return micro_batch(*ints, pad_token_id, rows, floats, routed_experts, share_prompts)


def micro_batch(
    prompts: Ragged,
    responses: Ragged,
    loss_mask: Ragged,
    pad_token_id: int,
    rows: np.ndarray,
    extras: dict[str, Ragged] | None = None,
    routed_experts: Sequence[Sequence[Sequence[int]]] | None = None,
    share_prompts: bool = False,
) -> MicroBatch:
    """`rows` of the columns as one micro-batch: prompt + response right-padded to the longest,
    response tensors to the longest response; `routed_experts` per row of `rows`."""
    if not len(rows):
        raise ValueError("cannot build a micro-batch from zero rows")
    p_len, r_len = prompts.lengths(rows), responses.lengths(rows)
    width, r_width = int((p_len + r_len).max()), max(1, int(r_len.max()))
    seqs = prompts.padded(rows, width, pad_token_id, np.int64)
    input_ids = torch.from_numpy(responses.placed(seqs, rows, p_len))
    attention = torch.from_numpy((np.arange(width) < (p_len + r_len)[:, None]).astype(np.int64))
    prompt_len = torch.from_numpy(p_len)
    positions = (prompt_len.unsqueeze(1) - 1 + torch.arange(r_width)).clamp(max=width - 1)
    resp = torch.from_numpy(responses.padded(rows, r_width, pad_token_id, np.int64))
    mask = torch.from_numpy(loss_mask.padded(rows, r_width, 0, np.float32))
    ext = {
        k: torch.from_numpy(v.padded(rows, r_width, 0.0, np.float32))
        for k, v in (extras or {}).items()
    }
    experts = None
    if routed_experts is not None:
        experts = _experts_tensor(routed_experts, (p_len + r_len).tolist(), width)
    shared = None
    if share_prompts and experts is None:
        shared = shared_prompts(prompts, rows, r_len, pad_token_id, r_width)
    return MicroBatch(
        input_ids, attention, resp, positions, mask, ext, routed_experts=experts, shared=shared
    )


def shared_prompts(
    prompts: Ragged, rows: np.ndarray, r_len: np.ndarray, pad_token_id: int, r_width: int
) -> SharedPrompts | None:
    """The distinct prompts among `rows` (first-seen order), or None when none repeats."""
    starts, ends = prompts.offsets[rows].tolist(), prompts.offsets[rows + 1].tolist()
    index: dict[bytes, int] = {}
    row, firsts = [], []
    for k, (a, b) in enumerate(zip(starts, ends, strict=True)):
        row.append(index.setdefault(prompts.values[a:b].tobytes(), len(index)))
        if len(index) > len(firsts):
            firsts.append(k)
    if len(index) == len(row):
        return None
    distinct = rows[firsts]
    lengths = prompts.lengths(distinct)
    width = int(lengths.max())
    ids = np.full((len(distinct), width), pad_token_id, dtype=np.int64)
    ids = prompts.placed(ids, distinct, width - lengths)  # left-padded
    mask = (np.arange(width) >= (width - lengths)[:, None]).astype(np.int64)
    response_mask = (np.arange(r_width) < r_len[:, None]).astype(np.int64)
    return SharedPrompts(
        torch.from_numpy(ids),
        torch.from_numpy(mask),
        torch.tensor(row),
        torch.from_numpy(response_mask),
    )


def _experts_tensor(
    rows: Sequence[Sequence[Sequence[int]]], seq_lengths: list[int], width: int
) -> torch.Tensor:
    """[B, width, num_layers * top_k] long, each row's experts from its first token on."""
    per_token = {len(tokens[0]) for tokens in rows if len(tokens)}
    if len(per_token) > 1:
        raise ValueError(f"routed_experts: rows differ in experts per token ({sorted(per_token)})")
    out = torch.zeros((len(rows), width, per_token.pop() if per_token else 0), dtype=torch.long)
    for i, (tokens, seq_len) in enumerate(zip(rows, seq_lengths, strict=True)):
        if len(tokens) > seq_len:
            raise ValueError(
                f"routed_experts: row {i} has experts for {len(tokens)} tokens, its sequence "
                f"{seq_len}"
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
