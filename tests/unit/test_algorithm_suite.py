"""GSPO, SAPO, decoupled PPO, rollout corrections, Dr. GRPO, dual clip, distillation and DAPO
pieces against values derived by hand (the arithmetic is in the comments)."""

from __future__ import annotations

import math

import pytest
import torch

from relax_core.algorithms import (
    POLICY_LOSSES,
    LossInputs,
    LossSettings,
    aggregate,
    broadcast_to_tokens,
    distillation_advantages,
    interpolate_proximal,
    proximal_alpha,
)
from relax_core.algorithms.dapo import has_signal, overlong_penalty
from relax_core.algorithms.sapo import sapo_gate


def close(actual: torch.Tensor, expected, atol: float = 1e-5) -> None:
    torch.testing.assert_close(
        actual, torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-5
    )


def loss(name: str, inputs: LossInputs, num_tokens=None, num_seqs=None, **settings):
    return POLICY_LOSSES[name](inputs, LossSettings(**settings), num_tokens, num_seqs)


def tokens(logp, old, adv, mask=None, **extra) -> LossInputs:
    logp = torch.tensor(logp, requires_grad=True)
    return LossInputs(
        logprobs=logp,
        old_logprobs=torch.tensor(old),
        advantages=torch.tensor(adv),
        loss_mask=torch.ones_like(logp) if mask is None else torch.tensor(mask),
        **extra,
    )


# ----------------------------------------------------------------------------- GSPO


def test_gspo_uses_one_clipped_ratio_per_sequence():
    # seq 0: log-ratios 0.2, 0.0 -> mean 0.1 -> s = e^0.1 = 1.105171, A = +1
    # seq 1: log-ratios -0.001, 0.001 (third token masked) -> mean 0 -> s = 1, A = -1
    # clip range [1 - 3e-4, 1 + 4e-4]: seq 0 is clipped to 1.0004 (A > 0, r above the range):
    #   per token max(-1.105171, -1.0004) = -1.0004, no gradient
    # seq 1 inside: per token max(1, 1) = 1
    # seq_mean_token_mean: (-1.0004 + 1) / 2 = -0.0002
    inputs = tokens(
        [[0.2, 0.0, 0.0], [-0.001, 0.001, 5.0]],
        [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        [[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]],
        [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]],
    )
    value, metrics = loss(
        "gspo", inputs, eps_clip=3e-4, eps_clip_high=4e-4, agg="seq_mean_token_mean"
    )
    close(value, -0.0002)
    close(metrics["clip_frac"], 0.5)  # 2 of 4 masked tokens belong to the clipped sequence
    close(metrics["ratio_mean"], (1.105171 * 2 + 1.0 * 2) / 4)
    value.backward()
    # seq 1: d/dlogp_t of (1/2) * (1/2) * (-A * s) per token = (1/4) * (+1) * 1 = 0.25
    close(inputs.logprobs.grad, [[0.0, 0.0, 0.0], [0.25, 0.25, 0.0]])


def test_gspo_gradient_is_the_sequence_ratio_gradient():
    # On-policy (ratio 1) with a wide range nothing clips; the gradient per token is
    # -A * s / (B * |y|): A = 2, s = 1, B = 1, |y| = 4 -> -0.5 on each token.
    inputs = tokens([[-1.0, -2.0, -0.5, -3.0]], [[-1.0, -2.0, -0.5, -3.0]], [[2.0] * 4])
    value, _ = loss("gspo", inputs, eps_clip=0.01, eps_clip_high=0.01, agg="seq_mean_token_mean")
    value.backward()
    close(value, -2.0)
    close(inputs.logprobs.grad, [[-0.5] * 4])


# ----------------------------------------------------------------------------- SAPO


def test_sapo_gate_values_and_gradient():
    # f(r) = (4 / tau) * sigmoid(tau * (r - 1)); at r = 1: (4 / tau) * 0.5 = 2 / tau
    # tau_pos = 1 for A > 0: f(1) = 2; tau_neg = 2 for A < 0: f(1) = 1
    ratio = torch.tensor([[1.0, 1.0]])
    close(sapo_gate(ratio, torch.tensor([[1.0, -1.0]]), 1.0, 2.0), [[2.0, 1.0]])
    # r = 2, tau 1: 4 * sigmoid(1) = 4 * 0.7310586 = 2.9242344
    close(sapo_gate(torch.tensor([[2.0]]), torch.tensor([[1.0]]), 1.0, 2.0), [[2.9242344]])
    # Loss -f(r) * A. Token 0: r = 1, A = +1: -2; token 1: r = e^1 = 2.7182818, A = -1, tau 2:
    # f = 2 * sigmoid(2 * 1.7182818) = 2 * 0.9689 ... = 1.9379; loss +1.9379
    inputs = tokens([[0.0, 1.0]], [[0.0, 0.0]], [[1.0, -1.0]])
    value, metrics = loss("sapo", inputs, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    s1 = 1 / (1 + math.exp(-2 * (math.e - 1)))
    close(value, (-2.0 + 2 * s1) / 2)
    value.backward()
    # d/dlogp of -A f(r) = -A * 4 s (1 - s) * r, over 2 tokens:
    # token 0: -1 * 4 * 0.25 * 1 / 2 = -0.5; token 1: +1 * 4 * s1 (1 - s1) * e / 2
    close(inputs.logprobs.grad, [[-0.5, 4 * s1 * (1 - s1) * math.e / 2]])
    close(metrics["gate_mean"], (1.0 + 4 * s1 * (1 - s1)) / 2)


def test_sapo_outside_the_clip_range_fades_instead_of_cutting_off():
    # r = e^1.5 = 4.481689 with A = +1, tau 1: s = sigmoid(3.481689) = 0.970162;
    # gradient -4 s (1 - s) r = -4 * 0.970162 * 0.029838 * 4.481689 = -0.518934.
    # GRPO clips this token (r > 1.28): gradient exactly 0.
    inputs = tokens([[1.5]], [[0.0]], [[1.0]])
    value, _ = loss("sapo", inputs)
    value.backward()
    s = 1 / (1 + math.exp(-(math.exp(1.5) - 1)))
    close(inputs.logprobs.grad, [[-4 * s * (1 - s) * math.exp(1.5)]])
    assert abs(inputs.logprobs.grad.item() + 0.518934) < 1e-5
    clipped = tokens([[1.5]], [[0.0]], [[1.0]])
    loss("grpo", clipped)[0].backward()
    close(clipped.logprobs.grad, [[0.0]])


# ----------------------------------------------------------------------------- dual clip, Dr. GRPO


def test_dual_clip_caps_a_negative_advantage_token():
    # r = e^2 = 7.389, A = -1: PPO loss max(7.389, 1.28) = 7.389; dual clip c = 3 caps it at 3
    # (no gradient); A = +1 tokens are untouched: r = 1 -> -1
    inputs = tokens([[2.0], [0.0]], [[0.0], [0.0]], [[-1.0], [1.0]])
    value, metrics = loss("grpo", inputs, dual_clip=3.0)
    close(value, (3.0 - 1.0) / 2)
    close(metrics["clip_frac"], 0.5)
    value.backward()
    close(inputs.logprobs.grad, [[0.0], [-0.5]])


def test_dr_grpo_divides_by_sequences_times_the_budget():
    # values 1, 2 | 3 (masked 4th) -> sum 6; 2 sequences x norm_len 4 = 8 -> 0.75
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    close(aggregate(values, mask, "dr_grpo", norm_len=4.0), 0.75)
    # global count across micro-batches: 5 sequences -> 6 / 20
    close(aggregate(values, mask, "dr_grpo", num_seqs=5.0, norm_len=4.0), 0.3)
    with pytest.raises(ValueError, match="norm_len > 0"):
        LossSettings(agg="dr_grpo")


# ----------------------------------------------------------------------------- rollout corrections


def _mismatch_inputs():
    # trainer (old) vs rollout log-probs: log w = old - rollout = [ln 3, ln 0.25, 0]
    return tokens(
        [[0.0, 0.0, 0.0]],
        [[0.0, 0.0, 0.0]],
        [[1.0, 1.0, 1.0]],
        rollout_logprobs=torch.tensor([[-math.log(3.0), math.log(4.0), 0.0]]),
    )


def test_tis_truncates_token_weights():
    # w = [3, 0.25, 1] -> truncated at 2: [2, 0.25, 1]; pg per token -1 (r 1, A 1)
    # loss = mean(-2, -0.25, -1) = -3.25 / 3
    value, metrics = loss("grpo", _mismatch_inputs(), is_mode="tis", is_cap=2.0)
    close(value, -3.25 / 3)
    close(metrics["is_truncated_frac"], 1 / 3)
    close(metrics["is_weight_mean"], (3 + 0.25 + 1) / 3)


def test_mis_masks_tokens_outside_the_band():
    # band [1/2, 2]: w 3 and 0.25 are dropped, 1 kept -> loss = (0 + 0 - 1) / 3
    value, metrics = loss("grpo", _mismatch_inputs(), is_mode="mis", is_cap=2.0)
    close(value, -1 / 3)
    close(metrics["is_masked_frac"], 2 / 3)


def test_sequence_level_weight_is_the_product_over_the_response():
    # sum of log w = ln 3 + ln 0.25 + 0 = ln 0.75 -> w = 0.75 on every token; TIS cap 2 keeps it
    value, _ = loss("grpo", _mismatch_inputs(), is_mode="tis", is_level="sequence")
    close(value, -0.75)


def test_correction_needs_rollout_logprobs():
    with pytest.raises(ValueError, match="rollout_logprobs"):
        loss("grpo", tokens([[0.0]], [[0.0]], [[1.0]]), is_mode="tis")


# ----------------------------------------------------------------------------- decoupled PPO


def test_decoupled_ppo_weights_by_truncated_behaviour_ratio():
    # proximal (old) log-probs 0; behaviour (rollout) [ln 0.5, ln 0.25] -> w = [2, 4] -> cap 3:
    # [2, 3]. Ratio to proximal 1, A 1 -> pg -1 per token -> loss mean(-2, -3) = -2.5
    inputs = tokens(
        [[0.0, 0.0]],
        [[0.0, 0.0]],
        [[1.0, 1.0]],
        rollout_logprobs=torch.tensor([[math.log(0.5), math.log(0.25)]]),
    )
    value, metrics = loss("decoupled_ppo", inputs, behaviour_cap=3.0)
    close(value, -2.5)
    close(metrics["behaviour_weight_mean"], 2.5)
    value.backward()
    close(inputs.logprobs.grad, [[-1.0, -1.5]])


def test_proximal_interpolation_is_exact_at_both_ends():
    # on-policy rows (behaviour = train version 5): first update (progress 0) -> alpha 1
    # (proximal = current); a later update of the same batch (progress 0.5) -> alpha 0
    # (proximal = behaviour). A row 2 versions stale at progress 0.5: (5-3)/(5.5-3) = 0.8
    alpha = proximal_alpha(torch.tensor([5, 5, 3]), 5, 0.0)
    close(alpha, [[1.0], [1.0], [1.0]])
    alpha = proximal_alpha(torch.tensor([5, 3]), 5, 0.5)
    close(alpha, [[0.0], [0.8]])
    behaviour, current = torch.tensor([[-2.0]]), torch.tensor([[-1.0]], requires_grad=True)
    prox = interpolate_proximal(behaviour, current, torch.tensor([[0.8]]))
    close(prox, [[-1.2]])  # -2 + 0.8 * (-1 - -2)
    assert not prox.requires_grad


# ----------------------------------------------------------------------------- distillation, DAPO


def test_distillation_adds_the_teacher_gap_per_token():
    # A = 1; student - teacher = [-1, 0.5, (masked)] -> 1 - 0.5 * gap = [1.5, 0.75, 1]
    adv = distillation_advantages(
        torch.tensor([1.0, 1.0, 1.0]),
        torch.tensor([-2.0, -1.0, 9.0]),
        torch.tensor([-1.0, -1.5, 0.0]),
        torch.tensor([1.0, 1.0, 0.0]),
        coef=0.5,
    )
    close(adv, [1.5, 0.75, 1.0])


def test_dapo_signal_and_overlong_penalty():
    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0, 1.0]) and not has_signal([1.0])
    # budget 16, buffer 4: 12 tokens free, 13 -> 0.25, 14 -> 0.5, 16 -> 1 (x penalty 0.5)
    assert [overlong_penalty(n, 16, 4, 0.5) for n in (12, 13, 14, 16)] == [0, 0.125, 0.25, 0.5]
    assert overlong_penalty(16, 16, 0, 1.0) == 0.0


# ----------------------------------------------------------------------------- edge cases, invariance


@pytest.mark.parametrize("name", ["grpo", "gspo", "sapo", "decoupled_ppo"])
def test_all_masked_rows_and_empty_responses_give_zero_loss_and_zero_gradient(name):
    # an empty response is a row with no masked token
    inputs = tokens(
        [[0.3, -0.2]],
        [[0.0, 0.0]],
        [[1.0, 1.0]],
        mask=[[0.0, 0.0]],
        rollout_logprobs=torch.zeros(1, 2),
    )
    value, _ = loss(name, inputs, eps_clip=1e-3, eps_clip_high=1e-3)
    value.backward()
    close(value, 0.0)
    close(inputs.logprobs.grad, [[0.0, 0.0]])


@pytest.mark.parametrize("name", ["grpo", "gspo", "sapo", "decoupled_ppo"])
def test_zero_std_group_gives_zero_policy_gradient(name):
    # equal rewards -> advantages 0 -> no policy gradient whatever the ratio
    inputs = tokens([[0.4, -0.3]], [[0.0, 0.0]], [[0.0, 0.0]], rollout_logprobs=torch.zeros(1, 2))
    value, _ = loss(name, inputs, eps_clip=1e-3, eps_clip_high=1e-3)
    value.backward()
    close(inputs.logprobs.grad, [[0.0, 0.0]])


def _random(batch: int, length: int):
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([1, 5, 3, 2, 5, 4, 1, 3])[:batch]
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    logp = -torch.rand(batch, length, generator=gen) * 3
    return {
        "logprobs": logp,
        "old_logprobs": logp + 0.05 * torch.randn(batch, length, generator=gen),
        "rollout_logprobs": logp + 0.05 * torch.randn(batch, length, generator=gen),
        "advantages": broadcast_to_tokens(torch.randn(batch, generator=gen), mask),
        "loss_mask": mask,
    }


@pytest.mark.parametrize(
    ("name", "settings"),
    [
        ("gspo", {"eps_clip": 3e-4, "eps_clip_high": 4e-4, "agg": "seq_mean_token_mean"}),
        ("sapo", {}),
        ("decoupled_ppo", {}),
        ("grpo", {"agg": "dr_grpo", "norm_len": 5.0, "is_mode": "tis", "dual_clip": 3.0}),
        ("grpo", {"is_mode": "mis", "is_level": "sequence", "agg": "seq_mean_token_mean"}),
    ],
)
def test_eight_micro_batches_of_one_give_the_gradient_of_one_batch_of_eight(name, settings):
    # 1 + 5 + 3 + 2 + 5 + 4 + 1 + 3 = 24 tokens in 8 sequences; tolerance: float32 round-off
    data = _random(8, 5)

    def run(rows: list[slice]) -> tuple[torch.Tensor, torch.Tensor]:
        logp = data["logprobs"].clone().requires_grad_(True)
        total = torch.zeros(())
        for part in rows:
            rest = {k: v[part] for k, v in data.items() if k != "logprobs"}
            value, _ = loss(name, LossInputs(logprobs=logp[part], **rest), 24.0, 8.0, **settings)
            total = total + value
        total.backward()
        return total.detach(), logp.grad

    whole = run([slice(0, 8)])
    micro = run([slice(i, i + 1) for i in range(8)])
    torch.testing.assert_close(whole, micro, atol=1e-6, rtol=1e-5)
    assert whole[1].abs().sum() > 0
