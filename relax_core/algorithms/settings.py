"""The knobs every policy loss reads, in one frozen value (built from AlgorithmConfig by the
trainer, so the pure loss functions never import the config)."""

from __future__ import annotations

from dataclasses import dataclass

IS_MODES = ("none", "tis", "mis")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossSettings:
    eps_clip: float = 0.2
    """Lower clip: ratio >= 1 - eps_clip (GSPO uses ~3e-4 on its sequence ratio)."""
    eps_clip_high: float = 0.28
    """Upper clip: ratio <= 1 + eps_clip_high."""
    dual_clip: float = 0.0
    """Dual-clip c > 1 caps the loss of negative-advantage tokens at -A * c (0 = off)."""
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    entropy_coef: float = 0.0
    agg: str = "token_mean"
    """token_mean | seq_mean_token_mean | dr_grpo (sum over tokens / (num_seqs * norm_len))."""
    norm_len: float = 0.0
    """dr_grpo's fixed per-sequence length (the generation budget)."""
    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for positive advantages."""
    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for negative advantages."""
    is_mode: str = "none"
    """Rollout-vs-train importance correction: none | tis (truncate) | mis (mask)."""
    is_level: str = "token"
    """token | sequence (one weight per response: exp of the summed log-ratio)."""
    is_cap: float = 2.0
    """TIS truncates weights at is_cap; MIS drops tokens/sequences outside [1/is_cap, is_cap]."""
    behaviour_cap: float = 2.0
    """Decoupled PPO: cap of the behaviour weight pi_prox / pi_behaviour."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("eps_clip", "eps_clip_high", "kl_coef", "entropy_coef", "norm_len"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.dual_clip and self.dual_clip <= 1:
            problems.append(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        for name in ("sapo_tau_pos", "sapo_tau_neg"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        if self.is_mode not in IS_MODES:
            problems.append(f"is_mode must be one of {list(IS_MODES)}, got {self.is_mode!r}")
        if self.is_level not in IS_LEVELS:
            problems.append(f"is_level must be one of {list(IS_LEVELS)}, got {self.is_level!r}")
        if self.is_cap <= 1:
            problems.append(f"is_cap must be > 1, got {self.is_cap}")
        if self.behaviour_cap <= 1:
            problems.append(f"behaviour_cap must be > 1, got {self.behaviour_cap}")
        if self.agg == "dr_grpo" and self.norm_len <= 0:
            problems.append("agg 'dr_grpo' needs norm_len > 0 (the generation budget)")
        if problems:
            raise ValueError("bad loss settings: " + "; ".join(problems))
