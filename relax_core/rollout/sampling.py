"""Token sampling from logits: temperature, nucleus (top-p), greedy. Pure tensor functions."""

from __future__ import annotations

import torch


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_p: float,
    greedy: bool,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row, on the logits' device.

    logits: [B, V] float. Returns (tokens [B] int64, logprobs [B] float32) on that device, where
    logprobs are log-probabilities of the chosen tokens under softmax(logits / temperature), the
    distribution the trainer recomputes, not the truncated top-p one.

    Sampling inverts each row's CDF at one uniform draw: the B uniforms come from `generator`
    (a CPU generator, whose state an engine checkpoints), so the draws depend on that state
    alone, whatever device or thread count computes the CDF. torch.multinomial on a CPU
    generator instead draws one exponential per vocabulary entry: 10M draws a step for 64 rows
    of a 152k vocabulary, a quarter second on the CPU, and the logits had to come to the CPU.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if greedy:
        tokens = logp.argmax(dim=-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            probs = _top_p_filter(probs, top_p)
        tokens = inverse_cdf(probs, uniforms(len(probs), generator, probs.device))
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def uniforms(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """n draws from U[0, 1) in float64, from `generator` (CPU), moved to `device`."""
    return torch.rand(n, generator=generator, dtype=torch.float64).to(device)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] token ids: per row, the first index whose cumulative mass exceeds u times the row's
    total (rows need not sum to 1, so a top-p filtered row needs no renormalizing). Summed in
    float64, so a 152k-entry row loses no token's share to rounding; a zero-probability token
    is never chosen."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return tokens.clamp(max=probs.shape[-1] - 1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches top_p. probs: [B, V]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
