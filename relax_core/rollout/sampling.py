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
    """Pick one token per row.

    logits: [B, V] float. Returns (tokens [B] int64, logprobs [B] float32) where logprobs are
    log-probabilities of the chosen tokens under softmax(logits / temperature), the distribution the
    trainer recomputes, not the truncated top-p one.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    if greedy:
        tokens = logp.argmax(dim=-1)
    else:
        probs = logp.exp()
        if top_p < 1.0:
            probs = _top_p_filter(probs, top_p)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero the tail outside the smallest set of tokens whose mass reaches top_p. probs: [B, V]."""
    sorted_p, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    sorted_p = sorted_p.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_p)
