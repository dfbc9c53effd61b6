"""The knobs every policy loss reads, in one frozen value (built from AlgorithmConfig by the
trainer, so the pure loss functions never import the config)."""

from __future__ import annotations

from dataclasses import dataclass

IS_MODES = ("none", "tis", "mis", "icepop")
IS_LEVELS = ("token", "sequence", "geometric")
SEQ_MASKS = ("none", "kl", "ratio")


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
    """Rollout-vs-train correction: none | tis (truncate) | mis (mask) | icepop (band mask)."""
    is_level: str = "token"
    """token | sequence (exp of the summed log-ratio) | geometric (exp of its mean)."""
    is_cap: float = 2.0
    """TIS truncates weights at is_cap; MIS drops tokens/sequences outside [1/is_cap, is_cap]."""
    icepop_low: float = 0.5
    """IcePop keeps a token's weight only inside [icepop_low, icepop_high]."""
    icepop_high: float = 5.0
    seq_mask: str = "none"
    """Off-policy sequence masking (OPSM): none | kl | ratio (corrections.py)."""
    seq_mask_threshold: float = 0.3
    """OPSM: the per-token mean log-ratio beyond which a sequence is dropped."""
    token_masks: bool = False
    """Also return per-token masked/clipped masks ("_token/..."), for per-staleness metrics."""
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
        if self.is_mode == "icepop" and self.is_level != "token":
            problems.append("is_mode 'icepop' masks tokens: is_level must be 'token'")
        if not 0 < self.icepop_low < 1 < self.icepop_high:
            problems.append(
                f"icepop band must satisfy 0 < low < 1 < high, got "
                f"[{self.icepop_low}, {self.icepop_high}]"
            )
        if self.seq_mask not in SEQ_MASKS:
            problems.append(f"seq_mask must be one of {list(SEQ_MASKS)}, got {self.seq_mask!r}")
        if self.seq_mask_threshold <= 0:
            problems.append(f"seq_mask_threshold must be > 0, got {self.seq_mask_threshold}")
        if self.is_cap <= 1:
            problems.append(f"is_cap must be > 1, got {self.is_cap}")
        if self.behaviour_cap <= 1:
            problems.append(f"behaviour_cap must be > 1, got {self.behaviour_cap}")
        if self.agg == "dr_grpo" and self.norm_len <= 0:
            problems.append("agg 'dr_grpo' needs norm_len > 0 (the generation budget)")
        if problems:
            raise ValueError("bad loss settings: " + "; ".join(problems))
