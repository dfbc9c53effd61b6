"""Per-token log-probs and entropy from vocab-parallel logits (each TP rank holds V/tp columns).

log p(target) = -vocab_parallel_cross_entropy (megatron.core.tensor_parallel); the entropy uses
the same all-reduced max and normalizer: H = log Z - sum_v p_v * (logit_v - max).
"""

from __future__ import annotations

import torch


def vocab_parallel_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, R], entropy [B, R]) from logits [B, R, V/tp] and token ids [B, R]."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    scaled = logits.float() / temperature
    # vocab_parallel_cross_entropy shifts its input in place: give it its own copy.
    logprobs = -tensor_parallel.vocab_parallel_cross_entropy(scaled.clone(), targets)
    top = scaled.detach().amax(dim=-1, keepdim=True)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - top
    exp = shifted.exp()
    normalizer = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1), group)
    probs = exp / normalizer.unsqueeze(-1)
    weighted = reduce_from_tensor_model_parallel_region((probs * shifted).sum(dim=-1), group)
    entropy = normalizer.log() - weighted
    return logprobs, entropy
