"""Per-token estimators of KL(policy || reference) from log-probs of the sampled tokens.

All three are Monte-Carlo estimates built from ``log r = ref - logp`` on tokens sampled from the
policy: k1 is unbiased but can be negative, k2 is low-variance but biased, k3 is unbiased and
never negative (J. Schulman, "Approximating KL divergence", 2020).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# exp() of a float32 log-ratio overflows to inf past ~88; a token whose reference log-prob is
# that far off already has a huge penalty, so capping keeps the loss finite instead of NaN.
_MAX_LOG_RATIO = 20.0


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """[B, T] ``logp - ref``."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """[B, T] ``0.5 * (logp - ref)^2``."""
    diff = logprobs - ref_logprobs
    return 0.5 * diff * diff


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """[B, T] ``exp(ref - logp) - (ref - logp) - 1``, always >= 0."""
    log_ratio = torch.clamp(ref_logprobs - logprobs, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}


def check_kl_kind(kind: str) -> None:
    """Raise ValueError unless ``kind`` names a KL estimator."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; allowed: {sorted(KL_ESTIMATORS)}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate [B, T] of the given ``kind`` ("k1", "k2" or "k3")."""
    check_kl_kind(kind)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"kl_penalty: logprobs {tuple(logprobs.shape)} and ref_logprobs "
            f"{tuple(ref_logprobs.shape)} differ in shape"
        )
    return KL_ESTIMATORS[kind](logprobs, ref_logprobs)
