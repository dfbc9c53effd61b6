"""Advantage estimators: one advantage per response from its reward, compared with the other
responses to its prompt (GRPO, RLOO) or with the whole batch (REINFORCE++).

Every estimator takes ``(rewards [N], group_index [N], normalize_std, lengths=None)`` and returns
[N]; ``lengths`` (trained tokens per response) weigh the batch statistics of REINFORCE++ per
token instead of per response when given.
"""

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
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool = True,
    lengths: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Advantages ``(r - mean_g) / (std_g + eps)`` where g is the group of each reward.

    rewards: [N] float; group_index: [N] int64 ids in 0..G-1, rows of a group in any order.
    Returns [N] float32 (or the rewards' float dtype).

    std is the population std (``unbiased=False``): it is defined for a group of one, and with
    it a group of two rewards {a, b} gets exactly +-1 (up to eps). A group whose rewards are all
    equal, including a group of one, gets advantage 0: it carries no signal about which
    response is better. With ``normalize_std=False`` the result is ``r - mean_g`` (Dr. GRPO).
    """
    del lengths
    values, centered, counts, index = _group_centered(rewards, group_index)
    if values.numel() == 0:
        return values.clone()
    if not normalize_std:
        return centered
    return centered / (_group_std(centered, counts, index) + eps)


def _group_centered(rewards: Tensor, group_index: Tensor):
    """(rewards as float, r - mean of its group, rows per group [G], index) of [N] rewards."""
    _check_groups(rewards, group_index)
    values = rewards if rewards.is_floating_point() else rewards.float()
    if values.numel() == 0:
        return values, values, values, group_index.long()
    index = group_index.long()
    zeros = torch.zeros(int(index.max()) + 1, dtype=values.dtype, device=values.device)
    # clamp: ids that are skipped (no rows) would otherwise divide by zero; they are never read.
    counts = zeros.index_add(0, index, torch.ones_like(values)).clamp(min=1)
    means = zeros.index_add(0, index, values) / counts
    return values, values - means[index], counts, index


def _group_std(centered: Tensor, counts: Tensor, index: Tensor) -> Tensor:
    """[N] population std of each row's group, from the group-centred values; two-pass (mean of
    squared deviations), so it stays exact for large, nearly equal rewards."""
    variances = torch.zeros_like(counts).index_add(0, index, centered * centered) / counts
    return variances.sqrt()[index]


def rloo_advantages(
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool = True,
    lengths: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """RLOO (Ahmadian et al., arXiv 2402.14740, Eq. 6): each response's baseline is the mean of
    the other responses to its prompt, ``A_i = r_i - mean_{j != i} r_j = G/(G-1) * (r_i - mean_g)``
    for a group of G: unbiased, unlike GRPO's own-inclusive mean. The published estimator is
    ``normalize_std=False``; with it True the result is also divided by the group's std, as GRPO
    does. A group of one gets 0.

    Example: rewards [1, 0, 0] in one group, not normalized: mean 1/3, G/(G-1) = 3/2, so
    A = [1, -1/2, -1/2] (= 1 - 0, 0 - 1/2, 0 - 1/2).
    """
    del lengths
    values, centered, counts, index = _group_centered(rewards, group_index)
    if values.numel() == 0:
        return values.clone()
    g = counts[index]
    loo = torch.where(g > 1, centered * g / (g - 1).clamp(min=1), torch.zeros_like(centered))
    if not normalize_std:
        return loo
    return loo / (_group_std(centered, counts, index) + eps)


def _batch_whiten(values: Tensor, lengths: Tensor | None, eps: float = 1e-6) -> Tensor:
    """(values - mean) / (std + eps) over the batch; weighted by ``lengths`` when given."""
    if values.numel() == 0:
        return values.clone()
    w = torch.ones_like(values) if lengths is None else lengths.to(values.dtype)
    total = w.sum().clamp(min=1e-12)
    mean = (w * values).sum() / total
    std = ((w * (values - mean) ** 2).sum() / total).sqrt()
    return (values - mean) / (std + eps)


def reinforce_pp_advantages(
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool = True,
    lengths: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ (Hu et al., arXiv 2501.03262, Sec. 3): no critic and no group baseline; the
    rewards are whitened over the whole batch, ``(r - mean_batch) / std_batch``. With
    ``lengths`` the batch mean and std weigh each response by its tokens, as the paper's
    token-level normalization does (OpenRLHF whitens over every masked token); without, each
    response counts once. ``normalize_std=False`` only centres.

    Example: rewards [1, 0, 0, 1] (any groups): mean 0.5, std 0.5, A = [1, -1, -1, 1].
    """
    _check_groups(rewards, group_index)
    values = rewards if rewards.is_floating_point() else rewards.float()
    whitened = _batch_whiten(values, lengths)
    if normalize_std or values.numel() == 0:
        return whitened
    w = torch.ones_like(values) if lengths is None else lengths.to(values.dtype)
    return values - (w * values).sum() / w.sum().clamp(min=1e-12)


def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool = True,
    lengths: Tensor | None = None,
) -> Tensor:
    """REINFORCE++ with the group baseline (arXiv 2501.03262, "REINFORCE++-baseline"): rewards
    minus their group's mean, then whitened over the batch (per token with ``lengths``), so the
    scale comes from the batch rather than each group's std (a group of nearly equal rewards is
    not blown up as in GRPO).

    Example: groups {1, 0} and {1, 1}: centred [0.5, -0.5, 0, 0]; batch mean 0, std sqrt(1/8),
    A = [0.5, -0.5, 0, 0] / 0.3536 = [1.414, -1.414, 0, 0].
    """
    values, centered, _, _ = _group_centered(rewards, group_index)
    if values.numel() == 0 or not normalize_std:
        return centered.clone()
    return _batch_whiten(centered, lengths)


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


def no_advantages(
    rewards: Tensor,
    group_index: Tensor,
    normalize_std: bool = True,
    lengths: Tensor | None = None,
) -> Tensor:
    """Zero advantage for every sample: training signal comes only from a per-token term (pure
    on-policy distillation, where the teacher's log-probs are the whole reward)."""
    _check_groups(rewards, group_index)
    del normalize_std, lengths
    return torch.zeros_like(rewards)
