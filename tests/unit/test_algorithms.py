"""Advantages, KL estimators, aggregation and the GRPO loss against values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch

from relax_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    POLICY_LOSSES,
    LossInputs,
    LossSettings,
    aggregate,
    broadcast_to_tokens,
    grpo_advantages,
    kl_penalty,
)

EPS = 1e-6


def close(actual: torch.Tensor, expected: list[float] | float, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5
    )


def one_token_inputs(ratios: list[float], advantages: list[float], **extra) -> LossInputs:
    """B tokens in a [B, 1] batch with the given ratio and advantage each (old logp = 0)."""
    logprobs = torch.tensor([[math.log(r)] for r in ratios], requires_grad=True)
    return LossInputs(
        logprobs=logprobs,
        old_logprobs=torch.zeros(len(ratios), 1),
        advantages=torch.tensor([[a] for a in advantages]),
        loss_mask=torch.ones(len(ratios), 1),
        **extra,
    )


def grpo(inputs: LossInputs, num_tokens=None, num_seqs=None, **settings):
    return POLICY_LOSSES["grpo"](inputs, LossSettings(**settings), num_tokens, num_seqs)


# ----------------------------------------------------------------------------- advantages


def test_grpo_advantages_of_one_group_are_plus_minus_one():
    # rewards [1, 0, 0, 1]: mean 0.5, deviations +-0.5, population std sqrt(0.25) = 0.5
    # -> +-0.5 / (0.5 + 1e-6) = +-0.999998
    adv = ADVANTAGE_ESTIMATORS["grpo"](torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.zeros(4).long())
    scale = 0.5 / (0.5 + EPS)
    close(adv, [scale, -scale, -scale, scale])


def test_equal_rewards_and_singleton_groups_get_zero_advantage():
    # group 0: all 0.7 -> deviations 0, std 0 -> 0 / (0 + eps) = 0; group 1: one row -> 0
    rewards = torch.tensor([0.7, 0.7, 0.7, 3.0])
    adv = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1]))
    close(adv, [0.0, 0.0, 0.0, 0.0])
    assert not torch.isnan(adv).any()


def test_non_contiguous_groups_are_normalized_separately():
    # group 0 = rows 0, 2, 5: rewards 1, 0, 2 -> mean 1, deviations 0, -1, 1,
    #   population std sqrt((0 + 1 + 1) / 3) = sqrt(2/3) = 0.816497
    # group 1 = rows 1, 3: rewards 4, 8 -> mean 6, deviations -2, 2, std 2 -> -1, +1
    # group 2 = row 4 alone -> 0
    rewards = torch.tensor([1.0, 4.0, 0.0, 8.0, 5.0, 2.0])
    groups = torch.tensor([0, 1, 0, 1, 2, 0])
    adv = grpo_advantages(rewards, groups)
    s0 = 1.0 / (math.sqrt(2 / 3) + EPS)
    s1 = 2.0 / (2.0 + EPS)
    close(adv, [0.0, -s1, -s0, s1, 0.0, s0])


def test_unnormalized_advantages_are_reward_minus_group_mean():
    # group 0: 1, 0 -> mean 0.5 -> +0.5, -0.5; group 1: 4, 8 -> mean 6 -> -2, +2
    adv = grpo_advantages(
        torch.tensor([1.0, 4.0, 0.0, 8.0]), torch.tensor([0, 1, 0, 1]), normalize_std=False
    )
    close(adv, [0.5, -2.0, -0.5, 2.0])


def test_advantage_input_errors_name_the_problem():
    with pytest.raises(ValueError, match="group_index has shape"):
        grpo_advantages(torch.zeros(3), torch.zeros(2).long())
    with pytest.raises(ValueError, match="int64"):
        grpo_advantages(torch.zeros(2), torch.zeros(2))
    with pytest.raises(ValueError, match="negative"):
        grpo_advantages(torch.zeros(2), torch.tensor([0, -1]))


def test_broadcast_to_tokens_fills_masked_positions_only():
    # sequence 0 has 2 response tokens, sequence 1 has 3
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    out = broadcast_to_tokens(torch.tensor([0.5, -2.0]), mask)
    close(out, [[0.5, 0.5, 0.0], [-2.0, -2.0, -2.0]])


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_at_known_values():
    # policy p = 0.5, reference q = 0.25: logp - ref = ln 2 = 0.693147
    # k1 = 0.693147; k2 = 0.5 * 0.693147^2 = 0.240227
    # k3 = exp(-ln 2) - (-ln 2) - 1 = 0.5 + 0.693147 - 1 = 0.193147
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    close(kl_penalty(logp, ref, "k1"), [0.693147])
    close(kl_penalty(logp, ref, "k2"), [0.240227])
    close(kl_penalty(logp, ref, "k3"), [0.193147])


def test_k3_is_never_negative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(64, generator=gen) * 5
    ref = -torch.rand(64, generator=gen) * 5
    assert (kl_penalty(logp, ref, "k3") >= 0).all()
    close(kl_penalty(logp, logp, "k3"), [0.0] * 64)


def test_k3_stays_finite_when_reference_is_far_off():
    # ref - logp = 200 would give exp(200) = inf in float32
    out = kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(out).all()


def test_unknown_kl_kind_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'k4'.*\['k1', 'k2', 'k3'\]"):
        kl_penalty(torch.zeros(1), torch.zeros(1), "k4")


# ----------------------------------------------------------------------------- aggregation

RAGGED_VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [9.0, 9.0, 9.0]])
# row 0: 3 tokens, row 1: 1 token, row 2: none
RAGGED_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_mean_over_a_ragged_mask():
    # (1 + 2 + 3 + 4) / 4 tokens = 2.5; padding 7s and the empty row's 9s are ignored
    close(aggregate(RAGGED_VALUES, RAGGED_MASK, "token_mean"), 2.5)


def test_seq_mean_token_mean_skips_empty_sequences():
    # row 0 mean (1 + 2 + 3) / 3 = 2, row 1 mean 4 / 1 = 4, row 2 has no tokens
    # -> (2 + 4) / 2 = 3
    close(aggregate(RAGGED_VALUES, RAGGED_MASK, "seq_mean_token_mean"), 3.0)


def test_global_denominators_replace_local_counts():
    # token_mean: 10 / num_tokens 8 = 1.25; seq mean: (2 + 4) / num_seqs 4 = 1.5
    close(aggregate(RAGGED_VALUES, RAGGED_MASK, "token_mean", num_tokens=8), 1.25)
    close(aggregate(RAGGED_VALUES, RAGGED_MASK, "seq_mean_token_mean", num_seqs=4), 1.5)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_empty_mask_gives_zero_loss_and_zero_gradient(mode):
    values = torch.full((2, 3), 5.0, requires_grad=True)
    loss = aggregate(values, torch.zeros(2, 3), mode)
    loss.backward()
    assert loss.item() == 0.0
    close(values.grad, [[0.0] * 3] * 2)


def test_unknown_aggregation_is_rejected():
    with pytest.raises(ValueError, match=r"unknown loss aggregation 'sum'.*token_mean"):
        aggregate(RAGGED_VALUES, RAGGED_MASK, "sum")


# ----------------------------------------------------------------------------- GRPO loss


def test_grpo_clip_selection_with_asymmetric_clip():
    # eps_clip 0.2, eps_clip_high 0.28 -> ratios clipped to [0.8, 1.28]
    # token 0: r 1.5,  A +1: max(-1.5, -1.28)  = -1.28  clipped (no gradient)
    # token 1: r 0.5,  A +1: max(-0.5, -0.8)   = -0.5   unclipped
    # token 2: r 0.5,  A -1: max(0.5, 0.8)     =  0.8   clipped
    # token 3: r 1.5,  A -1: max(1.5, 1.28)    =  1.5   unclipped
    # token 4: r 1.25, A +1: max(-1.25, -1.25) = -1.25  inside [0.8, 1.28]: unclipped
    inputs = one_token_inputs([1.5, 0.5, 0.5, 1.5, 1.25], [1.0, 1.0, -1.0, -1.0, 1.0])
    loss, metrics = grpo(inputs)
    # token mean: (-1.28 - 0.5 + 0.8 + 1.5 - 1.25) / 5 = -0.73 / 5 = -0.146
    close(loss, -0.146)
    close(metrics["pg_loss"], -0.146)
    # 2 of 5 tokens clipped
    close(metrics["clip_frac"], 0.4)
    # (1.5 + 0.5 + 0.5 + 1.5 + 1.25) / 5 = 1.05
    close(metrics["ratio_mean"], 1.05)
    loss.backward()
    # d/dlogp of -A * r / 5 is -A * r / 5: token 1 -0.5/5 = -0.1, token 3 1.5/5 = 0.3,
    # token 4 -1.25/5 = -0.25; clipped tokens 0 and 2 get 0
    close(inputs.logprobs.grad, [[0.0], [-0.1], [0.0], [0.3], [-0.25]])


def test_symmetric_clip_would_clip_what_eps_clip_high_keeps():
    # r 1.25, A +1: with eps_clip_high 0.2 the range is [0.8, 1.2] -> max(-1.25, -1.2) = -1.2
    loss, metrics = grpo(one_token_inputs([1.25], [1.0]), eps_clip_high=0.2)
    close(loss, -1.2)
    close(metrics["clip_frac"], 1.0)


def test_kl_and_entropy_terms_enter_the_loss():
    # ratio 1 and A 0 -> surrogate 0; logp - ref = ln 0.5 - ln 0.25 = ln 2 on both tokens
    # k1 term: 0.1 * 0.693147 = 0.0693147; entropy term: -0.01 * 2.0 = -0.02
    # loss = 0.0693147 - 0.02 = 0.0493147
    logp = torch.full((1, 2), math.log(0.5), requires_grad=True)
    inputs = LossInputs(
        logprobs=logp,
        old_logprobs=logp.detach().clone(),
        advantages=torch.zeros(1, 2),
        loss_mask=torch.ones(1, 2),
        ref_logprobs=torch.full((1, 2), math.log(0.25)),
        entropy=torch.full((1, 2), 2.0),
    )
    loss, metrics = grpo(inputs, kl_coef=0.1, kl_kind="k1", entropy_coef=0.01)
    close(loss, 0.0493147)
    close(metrics["kl"], 0.693147)
    close(metrics["entropy"], 2.0)
    assert all(not m.requires_grad and m.dim() == 0 for m in metrics.values())


def test_kl_off_needs_no_reference_and_reports_zero():
    _, metrics = grpo(one_token_inputs([1.0], [1.0]))
    close(metrics["kl"], 0.0)
    assert "entropy" not in metrics


def test_missing_reference_or_entropy_is_a_clear_error():
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo(one_token_inputs([1.0], [1.0]), kl_coef=0.1)
    with pytest.raises(ValueError, match=r"LossInputs\.entropy"):
        grpo(one_token_inputs([1.0], [1.0]), entropy_coef=0.01)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        grpo(one_token_inputs([1.0], [1.0]), kl_kind="kl")
    with pytest.raises(ValueError, match="unknown loss aggregation"):
        grpo(one_token_inputs([1.0], [1.0]), agg="mean")


def test_padding_garbage_changes_neither_loss_nor_gradient():
    # padded positions hold NaN/inf, as a masked forward pass may leave them
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    clean = torch.tensor([[math.log(1.5), math.log(0.5), 0.0]])
    dirty = torch.tensor([[math.log(1.5), math.log(0.5), float("nan")]])
    results = []
    for values in (clean, dirty):
        logp = values.clone().requires_grad_(True)
        inputs = LossInputs(
            logprobs=logp,
            old_logprobs=torch.tensor([[0.0, 0.0, float("inf")]]),
            advantages=torch.tensor([[1.0, 1.0, float("nan")]]),
            loss_mask=mask,
            ref_logprobs=torch.tensor([[0.0, 0.0, float("nan")]]),
        )
        # k2 and -A * r multiply by the padded value in backward: 0 * NaN would be NaN
        loss, _ = grpo(inputs, kl_coef=0.1, kl_kind="k2")
        loss.backward()
        results.append((loss.detach(), logp.grad))
    assert torch.isfinite(results[1][0]) and torch.isfinite(results[1][1]).all()
    torch.testing.assert_close(results[0], results[1])


def _random_batch(batch: int, length: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([1, 5, 3, 2, 5, 4, 1, 3])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    logp = -torch.rand(batch, length, generator=gen) * 3
    return {
        "logprobs": logp,
        "old_logprobs": logp + 0.3 * torch.randn(batch, length, generator=gen),
        "advantages": broadcast_to_tokens(torch.randn(batch, generator=gen), mask),
        "loss_mask": mask,
        "ref_logprobs": logp + 0.2 * torch.randn(batch, length, generator=gen),
        "entropy": torch.rand(batch, length, generator=gen),
    }


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_eight_micro_batches_of_one_equal_one_batch_of_eight(agg):
    data = _random_batch(8, 5)
    # 1 + 5 + 3 + 2 + 5 + 4 + 1 + 3 = 24 tokens in 8 non-empty sequences
    settings = {
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
        "agg": agg,
        "num_tokens": 24.0,
        "num_seqs": 8.0,
    }

    def run(rows: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
        logp = data["logprobs"].clone().requires_grad_(True)
        total = torch.zeros(())
        for rows_slice in rows:
            parts = {k: v[rows_slice] for k, v in data.items() if k != "logprobs"}
            loss, _ = grpo(LossInputs(logprobs=logp[rows_slice], **parts), **settings)
            total = total + loss
        total.backward()
        return total.detach(), logp.grad

    whole = run([slice(0, 8)])
    micro = run([slice(i, i + 1) for i in range(8)])
    torch.testing.assert_close(whole, micro)
    # the whole-batch loss with global counts is the plain local aggregation
    local, _ = grpo(LossInputs(**data), kl_coef=0.05, entropy_coef=0.01, agg=agg)
    torch.testing.assert_close(whole[0], local)


# ----------------------------------------------------------------------------- LossInputs


def test_loss_inputs_reject_mismatched_shape_and_attached_old_logprobs():
    ok = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2, 3),
        "loss_mask": torch.ones(2, 3),
    }
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\)"):
        LossInputs(**{**ok, "advantages": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="ref_logprobs has shape"):
        LossInputs(**ok, ref_logprobs=torch.zeros(3))
    with pytest.raises(ValueError, match="loss_mask must be a floating-point"):
        LossInputs(**{**ok, "loss_mask": torch.ones(2, 3, dtype=torch.bool)})
    with pytest.raises(ValueError, match="old_logprobs requires grad"):
        LossInputs(**{**ok, "old_logprobs": torch.zeros(2, 3, requires_grad=True)})
