"""CISPO, GMPO, IcePop, off-policy sequence masking, geometric-mean sequence IS, RLOO and
REINFORCE++ against values derived by hand (the arithmetic is in the comments), their config
checks, and the per-staleness mismatch metrics the trainer logs."""

from __future__ import annotations

import math

import pytest
import torch

from relax_core.algorithms import ADVANTAGE_ESTIMATORS
from relax_core.config import ConfigError, load_config, replace
from relax_core.roles.trainer import _count_by_staleness, mismatch_metrics
from tests.unit.test_algorithm_suite import close, loss, tokens

LN = math.log


def test_cispo_keeps_the_gradient_of_a_clipped_token_scaled_by_the_clipped_weight():
    # r = [1.5, 0.5], A = +1, clip [0.8, 1.28]: weights sg(clip(r)) = [1.28, 0.8].
    # value per token -A * w = [-1.28, -0.8]; token_mean -1.04.
    # d/dlogp_t = -A * w_t / 2 = [-0.64, -0.4] (GRPO would give token 0 no gradient: r > 1.28).
    logp = [[LN(0.5), LN(0.5)]]
    inputs = tokens(logp, [[LN(0.5) - LN(1.5), LN(0.5) - LN(0.5)]], [[1.0, 1.0]])
    value, metrics = loss("cispo", inputs)
    value.backward()
    close(value, -1.04)
    close(inputs.logprobs.grad, [[-0.64, -0.4]])
    close(metrics["clip_frac"], 1.0)  # both weights were clipped, both keep a gradient
    grpo_inputs = tokens(logp, [[LN(0.5) - LN(1.5), LN(0.5) - LN(0.5)]], [[1.0, 1.0]])
    grpo_value, _ = loss("grpo", grpo_inputs)
    grpo_value.backward()
    assert grpo_inputs.logprobs.grad[0, 0] == 0


@pytest.mark.parametrize(
    ("adv", "expected_value", "expected_grad"),
    [
        # A = +1: log r = [ln 2, ln 0.5], clipped in log space to [ln 0.8, ln 1.28] ->
        # [ln 1.28, ln 0.8]; min(log r, clipped) = [ln 1.28, ln 0.5]; geometric mean
        # exp((ln 1.28 + ln 0.5) / 2) = sqrt(0.64) = 0.8; loss -A * 0.8 = -0.8.
        # Token 0 is held by the clip (no gradient); token 1: d/dlogp = -A * 0.8 / 2 = -0.4.
        (1.0, -0.8, [[0.0, -0.4]]),
        # A = -1: max(log r, clipped) = [ln 2, ln 0.8]; exp((ln 2 + ln 0.8) / 2) = sqrt(1.6)
        # = 1.264911; loss +1.264911; token 0 free: d = +1.264911 / 2 = 0.632456; token 1 held.
        (-1.0, math.sqrt(1.6), [[math.sqrt(1.6) / 2, 0.0]]),
    ],
)
def test_gmpo_takes_the_geometric_mean_of_sign_clipped_token_ratios(
    adv, expected_value, expected_grad
):
    inputs = tokens([[0.0, 0.0]], [[-LN(2.0), -LN(0.5)]], [[adv, adv]])
    value, metrics = loss("gmpo", inputs, agg="seq_mean_token_mean")
    value.backward()
    close(value, expected_value)
    close(inputs.logprobs.grad, expected_grad)
    close(metrics["clip_frac"], 0.5)


def test_icepop_masks_tokens_whose_ratio_leaves_the_band():
    # w = exp(old - rollout) = [0.4, 1.0, 6.0]; band [0.5, 5]: only the middle token keeps w = 1.
    # GRPO at r = 1, A = +1: pg = -1 per token, weighted [0, -1, 0]; token_mean = -1/3;
    # gradient only on the kept token: -1/3.
    rollout = torch.tensor([[-LN(0.4), 0.0, -LN(6.0)]])
    inputs = tokens([[0.0, 0.0, 0.0]], [[0.0, 0.0, 0.0]], [[1.0] * 3], rollout_logprobs=rollout)
    value, metrics = loss("grpo", inputs, is_mode="icepop")
    value.backward()
    close(value, -1.0 / 3)
    close(inputs.logprobs.grad, [[0.0, -1.0 / 3, 0.0]])
    close(metrics["is_masked_frac"], 2.0 / 3)


def test_geometric_sequence_weight_is_the_mean_log_ratio_not_the_sum():
    # token weights [0.5, 4]: sequence (product) = 2.0, geometric = sqrt(0.5 * 4) = 1.414214.
    # GRPO at r = 1, A = +1: loss = -w (token_mean of -w over both tokens).
    rollout = torch.tensor([[LN(2.0), -LN(4.0)]])
    for level, expected in (("sequence", -2.0), ("geometric", -math.sqrt(2.0))):
        inputs = tokens([[0.0, 0.0]], [[0.0, 0.0]], [[1.0, 1.0]], rollout_logprobs=rollout)
        value, _ = loss("grpo", inputs, is_mode="tis", is_level=level, is_cap=3.0)
        close(value, expected)


@pytest.mark.parametrize(
    ("mode", "expected_value", "expected_frac"),
    [
        # Both rows: rollout - current = 0.5 per token > threshold 0.3. Row 0 has A = -1,
        # row 1 A = +1. GRPO at r = 1: pg row 0 = +1, row 1 = -1 per token.
        # kl drops only the negative-advantage row: (0 + 0 - 1 - 1) / 4 = -0.5, 1 of 2 masked.
        ("kl", -0.5, 0.5),
        # ratio drops every row whose |mean log-ratio| > 0.3: both; loss 0.
        ("ratio", 0.0, 1.0),
    ],
)
def test_off_policy_sequence_masking(mode, expected_value, expected_frac):
    rollout = torch.full((2, 2), 0.5)
    inputs = tokens(
        [[0.0, 0.0], [0.0, 0.0]],
        [[0.0, 0.0], [0.0, 0.0]],
        [[-1.0, -1.0], [1.0, 1.0]],
        rollout_logprobs=rollout,
    )
    value, metrics = loss("grpo", inputs, seq_mask=mode, seq_mask_threshold=0.3)
    close(value, expected_value)
    close(metrics["seq_masked_frac"], expected_frac)


def test_token_masks_are_reported_only_when_asked():
    rollout = torch.tensor([[-LN(0.4), 0.0]])
    inputs = tokens([[0.0, 0.0]], [[0.0, 0.0]], [[1.0, 1.0]], rollout_logprobs=rollout)
    _, quiet = loss("grpo", inputs, is_mode="icepop")
    assert not any(k.startswith("_token/") for k in quiet)
    _, full = loss("grpo", inputs, is_mode="icepop", token_masks=True)
    assert full["_token/masked"].tolist() == [[True, False]]
    assert full["_token/clipped"].tolist() == [[False, False]]


def test_rloo_baseline_leaves_each_response_out():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 5.0]), torch.tensor([0, 0, 0, 1])
    # group 0: r_i - mean of the others: 1 - 0 = 1, 0 - 0.5, 0 - 0.5; group of one -> 0.
    close(ADVANTAGE_ESTIMATORS["rloo"](rewards, groups, normalize_std=False), [1, -0.5, -0.5, 0])
    # normalized: / group std sqrt(((2/3)^2 + 2 (1/3)^2) / 3) = sqrt(2/9) = 0.471405
    s = math.sqrt(2 / 9)
    close(
        ADVANTAGE_ESTIMATORS["rloo"](rewards, groups, normalize_std=True),
        [1 / s, -0.5 / s, -0.5 / s, 0.0],
        atol=1e-4,
    )


def test_reinforce_pp_whitens_over_the_batch_per_response_or_per_token():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])
    # per response: mean 0.5, std 0.5 -> [1, -1, -1, 1]
    close(ADVANTAGE_ESTIMATORS["reinforce_pp"](rewards, groups), [1, -1, -1, 1], atol=1e-4)
    # per token, lengths [3, 1, 1, 3]: mean 6/8 = 0.75; var (3 * 0.25^2 + 2 * 0.75^2 +
    # 3 * 0.25^2) / 8 = 0.1875, std 0.433013 -> [0.57735, -1.73205, -1.73205, 0.57735]
    lengths = torch.tensor([3, 1, 1, 3])
    close(
        ADVANTAGE_ESTIMATORS["reinforce_pp"](rewards, groups, lengths=lengths),
        [0.57735, -1.73205, -1.73205, 0.57735],
        atol=1e-4,
    )


def test_reinforce_pp_with_the_group_baseline():
    # groups {1, 0} and {1, 1}: centred [0.5, -0.5, 0, 0]; batch std sqrt(0.5 / 4) = 0.353553
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    close(
        ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](rewards, groups),
        [1.414214, -1.414214, 0.0, 0.0],
        atol=1e-4,
    )


def test_mismatch_metrics_by_staleness():
    # Row 0 at staleness 0 (2 tokens, gaps 0.1 and 0.3, one masked); row 1 at staleness 2
    # (one live token of gap 0.2, clipped). kl_s0 = 0.4 / 2, kl_s2 = 0.2; overall 0.6 / 3.
    mismatch: dict[int, list[float]] = {}
    _count_by_staleness(
        mismatch,
        torch.tensor([[0.0, 0.0], [2.0, 2.0]]),
        torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        torch.tensor([[0.1, 0.3], [0.2, 0.0]]),
        torch.tensor([[True, False], [False, False]]),
        torch.tensor([[False, False], [True, False]]),
    )
    m = mismatch_metrics(mismatch)
    assert m["mismatch/kl_s0"] == pytest.approx(0.2)
    assert m["mismatch/kl_s2"] == pytest.approx(0.2)
    assert m["mismatch/masked_frac_s0"] == pytest.approx(0.5)
    assert m["mismatch/clipped_frac_s2"] == pytest.approx(1.0)
    assert m["mismatch/kl"] == pytest.approx(0.2)
    assert m["mismatch/masked_frac"] == pytest.approx(1 / 3)


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"is_mode": "icepop", "is_level": "sequence"}, "algorithm.is_level: is_mode 'icepop'"),
        ({"icepop_low": 1.5}, "algorithm.icepop_low/icepop_high"),
        ({"seq_mask": "always"}, "algorithm.seq_mask: 'always' is not one of none, kl, ratio"),
        ({"seq_mask": "kl", "seq_mask_threshold": 0.0}, "algorithm.seq_mask_threshold"),
        ({"advantage_level": "token"}, "algorithm.advantage_level: 'token'"),
        ({"loss": "gmpo", "eps_clip": 1.0}, "algorithm.eps_clip: gmpo"),
        ({"advantage": "ppo"}, "algorithm.advantage: 'ppo' is not one of grpo, rloo"),
    ],
)
def test_config_refuses_corrections_that_cannot_work(algorithm, message):
    base = load_config("configs/cpu-default.yaml")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        replace(base, algorithm=algorithm)


def test_config_accepts_every_new_loss_estimator_and_correction():
    base = load_config("configs/cpu-default.yaml")
    for algorithm in (
        {"loss": "cispo"},
        {"loss": "gmpo", "eps_clip": 0.33, "eps_clip_high": 0.49},
        {"is_mode": "icepop"},
        {"is_mode": "mis", "is_level": "geometric"},
        {"seq_mask": "kl"},
        {"seq_mask": "ratio"},
        {"advantage": "rloo", "normalize_adv_std": False},
        {"advantage": "reinforce_pp", "advantage_level": "token"},
        {"advantage": "reinforce_pp_baseline"},
    ):
        assert replace(base, algorithm=algorithm).algorithm.loss in ("grpo", "cispo", "gmpo")
