"""Group-relative advantages (GRPO): rewards compared with the other responses to a prompt."""

from __future__ import annotations

import torch
from torch import Tensor


def _check_groups(rewards: Tensor, group_index: Tensor) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_index.shape != rewards.shape:
        raise ValueError(
            f"group_index has shape {tuple(group_index.shape)}, expected {tuple(rewards.shape)} "
            "(one group id per reward)"
        )
    if group_index.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"group_index must be an int64 tensor of group ids, got {group_index.dtype}"
        )
    if group_index.numel() and int(group_index.min()) < 0:
        raise ValueError("group_index holds a negative id; group ids must be 0..G-1")


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Advantages ``(r - mean_g) / (std_g + eps)`` where g is the group of each reward.

    rewards: [N] float; group_index: [N] int64 ids in 0..G-1, rows of a group in any order.
    Returns [N] float32 (or the rewards' float dtype).

    std is the population std (``unbiased=False``): it is defined for a group of one, and with
    it a group of two rewards {a, b} gets exactly +-1 (up to eps). A group whose rewards are all
    equal, including a group of one, gets advantage 0: it carries no signal about which
    response is better. With ``normalize_std=False`` the result is ``r - mean_g`` (Dr. GRPO).
    """
    _check_groups(rewards, group_index)
    values = rewards if rewards.is_floating_point() else rewards.float()
    if values.numel() == 0:
        return values.clone()
    index = group_index.long()
    num_groups = int(index.max()) + 1
    zeros = torch.zeros(num_groups, dtype=values.dtype, device=values.device)
    # clamp: ids that are skipped (no rows) would otherwise divide by zero; they are never read.
    counts = zeros.index_add(0, index, torch.ones_like(values)).clamp(min=1)
    means = zeros.index_add(0, index, values) / counts
    centered = values - means[index]
    if not normalize_std:
        return centered
    # Two-pass variance (mean of squared deviations) stays exact for large, nearly equal rewards.
    variances = zeros.index_add(0, index, centered * centered) / counts
    stds = variances.sqrt()
    return centered / (stds[index] + eps)


def broadcast_to_tokens(adv: Tensor, loss_mask: Tensor) -> Tensor:
    """Spread one advantage per sequence over its tokens.

    adv: [N]; loss_mask: [N, T] float 0/1. Returns [N, T], ``adv[i]`` where the mask is 1 and
    0 on padding.
    """
    if adv.dim() != 1 or loss_mask.dim() != 2 or loss_mask.shape[0] != adv.shape[0]:
        raise ValueError(
            f"broadcast_to_tokens needs adv [N] and loss_mask [N, T], got "
            f"{tuple(adv.shape)} and {tuple(loss_mask.shape)}"
        )
    return adv[:, None] * loss_mask.to(adv.dtype)


def no_advantages(rewards: Tensor, group_index: Tensor, normalize_std: bool = True) -> Tensor:
    """Zero advantage for every sample: training signal comes only from a per-token term (pure
    on-policy distillation, where the teacher's log-probs are the whole reward)."""
    _check_groups(rewards, group_index)
    del normalize_std
    return torch.zeros_like(rewards)
