"""Value checks of the algorithm section: the losses, estimators and corrections
relax_core/algorithms/ implements (named here, since config imports nothing of it), their ranges,
and the combinations that make no sense."""

from __future__ import annotations

from relax_core.config.rules import choice, positive
from relax_core.config.sections import RunSections

LOSSES = ("grpo", "gspo", "sapo", "decoupled_ppo", "cispo", "gmpo")
ADVANTAGES = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "none")
KL_KINDS = ("k1", "k2", "k3")
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "dr_grpo")
IS_MODES = ("none", "tis", "mis", "icepop")
IS_LEVELS = ("token", "sequence", "geometric")
SEQ_MASKS = ("none", "kl", "ratio")


def check_algorithm(e: list[str], cfg: RunSections) -> None:
    """Knob ranges of the loss suite and the combinations that make no sense."""
    a, r, w = cfg.algorithm, cfg.rollout, cfg.reward
    choice(e, "algorithm.loss", a.loss, LOSSES)
    choice(e, "algorithm.advantage", a.advantage, ADVANTAGES)
    choice(e, "algorithm.advantage_level", a.advantage_level, ("sequence", "token"))
    choice(e, "algorithm.kl_kind", a.kl_kind, KL_KINDS)
    choice(e, "algorithm.loss_agg", a.loss_agg, LOSS_AGGS)
    choice(e, "algorithm.is_mode", a.is_mode, IS_MODES)
    choice(e, "algorithm.seq_mask", a.seq_mask, SEQ_MASKS)
    choice(e, "algorithm.proximal", a.proximal, ("interpolate", "behaviour"))
    if a.proximal == "behaviour" and a.is_mode != "none":
        e.append(
            "algorithm.is_mode: with proximal 'behaviour' the old log-probs are the rollout's, so "
            "the correction weight is always 1; use is_mode: none, or proximal: interpolate"
        )
    choice(e, "algorithm.is_level", a.is_level, IS_LEVELS)
    if a.dual_clip and a.dual_clip <= 1:
        e.append(f"algorithm.dual_clip: must be 0 (off) or > 1, got {a.dual_clip}")
    if a.dual_clip and a.loss == "sapo":
        e.append("algorithm.dual_clip: SAPO has no clip to dualize; set it to 0")
    for name in ("sapo_tau_pos", "sapo_tau_neg"):
        if not getattr(a, name) > 0:
            e.append(f"algorithm.{name}: must be > 0, got {getattr(a, name)}")
    for name in ("is_cap", "behaviour_cap"):
        if not getattr(a, name) > 1:
            e.append(f"algorithm.{name}: must be > 1, got {getattr(a, name)}")
    if a.loss == "gspo" and max(a.eps_clip, a.eps_clip_high) > 0.05:
        e.append(
            f"algorithm.eps_clip/eps_clip_high: GSPO clips a sequence-level ratio, which moves "
            f"far less than a token's; use ~3e-4 / 4e-4, got {a.eps_clip} / {a.eps_clip_high}"
        )
    if a.advantage_level == "token" and not a.advantage.startswith("reinforce_pp"):
        e.append(
            f"algorithm.advantage_level: 'token' weighs batch statistics by tokens, which only "
            f"the reinforce_pp estimators use; {a.advantage!r} compares within a group"
        )
    if a.is_mode == "icepop" and a.is_level != "token":
        e.append("algorithm.is_level: is_mode 'icepop' masks single tokens; use is_level: token")
    if not 0 < a.icepop_low < 1 < a.icepop_high:
        e.append(
            f"algorithm.icepop_low/icepop_high: need 0 < low < 1 < high, got "
            f"{a.icepop_low} / {a.icepop_high}"
        )
    if not a.seq_mask_threshold > 0:
        e.append(f"algorithm.seq_mask_threshold: must be > 0, got {a.seq_mask_threshold}")
    if a.proximal == "behaviour" and a.seq_mask == "ratio":
        e.append(
            "algorithm.seq_mask: 'ratio' compares the current policy with the rollout's, which "
            "proximal 'behaviour' already clips against; use seq_mask: kl or proximal: interpolate"
        )
    if a.loss == "gmpo" and a.eps_clip >= 1:
        e.append("algorithm.eps_clip: gmpo clips log r at log(1 - eps_clip); must be < 1")
    if a.loss == "decoupled_ppo" and a.is_mode != "none":
        e.append(
            "algorithm.is_mode: decoupled_ppo already weights by pi_proximal / pi_behaviour; "
            "a second rollout correction would apply it twice (set is_mode: none)"
        )
    if a.advantage == "none" and a.distill_coef == 0:
        e.append(
            "algorithm.advantage: 'none' leaves nothing to learn from without distill_coef > 0"
        )
    if a.distill_coef < 0:
        e.append(f"algorithm.distill_coef: must be >= 0, got {a.distill_coef}")
    if a.distill_coef > 0 and not a.teacher:
        e.append("algorithm.teacher: required when distill_coef > 0 (a checkpoint directory)")
    if a.teacher and a.distill_coef == 0:
        e.append(
            "algorithm.distill_coef: a teacher is set but distill_coef is 0 (it would be unused)"
        )
    if r.dynamic_sampling and r.n_samples_per_prompt < 2:
        e.append(
            "rollout.dynamic_sampling: needs n_samples_per_prompt >= 2 (groups of one never vary)"
        )
    positive(e, "rollout.max_sampling_rounds", r.max_sampling_rounds)
    positive(e, "reward.overlong_buffer", w.overlong_buffer, allow_zero=True)
    budget, budget_name = r.max_new_tokens, "rollout.max_new_tokens"
    if cfg.env.episodic:
        budget, budget_name = cfg.env.max_episode_tokens, "env.max_episode_tokens"
    if w.overlong_buffer >= budget > 0:
        e.append(
            f"reward.overlong_buffer: {w.overlong_buffer} must be below {budget_name} ({budget})"
        )
    if w.overlong_penalty < 0:
        e.append(f"reward.overlong_penalty: must be >= 0, got {w.overlong_penalty}")
