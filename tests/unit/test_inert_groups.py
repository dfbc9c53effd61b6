"""Groups whose advantages are all 0 stay out of the training forward and backward
(train.skip_inert_groups): the update is the whole batch's, only faster."""

from __future__ import annotations

import copy

import pyarrow as pa
import pytest
import torch

from relax_core.algorithms import POLICY_LOSSES, LossInputs, LossSettings
from relax_core.config import AlgorithmConfig, ModelConfig
from relax_core.data.prompts import PromptItem
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.queue import rows_to_table
from relax_core.rewards import resolve_reward
from relax_core.roles.advantages import add_advantages
from relax_core.roles.rollout import rollout_groups
from relax_core.roles.trainer import train_on_table
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batching import table_micro_batches
from relax_core.train.inert import live_groups, loss_counts
from relax_core.train.torch_backend import TorchBackend

SMALL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _batch(tok, rewards: list[list[float]]):
    """A tiny policy and its rollout of len(rewards) groups, rewarded as given, with GRPO
    advantages."""
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    items = [
        PromptItem(
            0, i, {"prompt": f"{i}+{i}=", "answer": str(2 * i)}, tok(f"{i}+{i}=")["input_ids"]
        )
        for i in range(len(rewards))
    ]
    rows, _ = rollout_groups(
        engine,
        tok,
        items,
        SamplingParams(max_new_tokens=4),
        len(rewards[0]),
        resolve_reward("math"),
    )
    for row, reward in zip(rows, [r for group in rewards for r in group], strict=True):
        row["reward"] = reward
    return model, add_advantages(rows_to_table(rows), "grpo", normalize_std=True)


# Groups 1 and 3 are all right / all wrong: advantage 0 on every sample.
REWARDS = [[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]]


def _train(model, table, algo, skip: bool, minibatches: int = 1):
    backend = TorchBackend(copy.deepcopy(model), lr=1e-2)
    metrics = train_on_table(
        backend, table, algo, 0, 4096, minibatches, max_new_tokens=4, skip_inert=skip
    )
    return backend, metrics


@pytest.mark.parametrize("minibatches", [1, 2])
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "dr_grpo"])
def test_skipping_inert_groups_makes_the_whole_batchs_update(tok, agg, minibatches):
    model, table = _batch(tok, REWARDS)
    algo = AlgorithmConfig(loss_agg=agg)
    whole, m_whole = _train(model, table, algo, skip=False, minibatches=minibatches)
    live, m_live = _train(model, table, algo, skip=True, minibatches=minibatches)
    assert m_whole["train/inert_groups"] == 0 and m_live["train/inert_groups"] == 2
    # The loss still divides by every token of the batch, skipped groups' included: dividing by
    # the trained rows' alone would scale the gradient up and show in the norm at once.
    assert m_live["train/grad_norm"] == pytest.approx(m_whole["train/grad_norm"], rel=1e-5)
    assert m_live["train/trained_tokens"] == m_whole["train/trained_tokens"]
    moved = max(
        float((p - q).detach().abs().max())
        for p, q in zip(whole.model.parameters(), model.parameters(), strict=True)
    )
    gap = max(
        float((p - q).abs().max())
        for p, q in zip(whole.model.parameters(), live.model.parameters(), strict=True)
    )
    assert moved > 1e-3 and gap < 1e-6, (moved, gap)


def test_a_kl_or_entropy_term_trains_every_group(tok):
    model, table = _batch(tok, REWARDS)
    _, metrics = _train(model, table, AlgorithmConfig(entropy_coef=0.01), skip=True)
    assert metrics["train/inert_groups"] == 0


def test_an_all_inert_batch_still_steps_the_optimizer(tok):
    model, table = _batch(tok, [[1, 1, 1, 1], [0, 0, 0, 0]])
    kept, left_out = live_groups(table)
    assert left_out == 1 and set(kept.column("group_id").to_pylist()) == {"e0-p0"}
    algo = AlgorithmConfig()
    whole, _ = _train(model, table, algo, skip=False)
    live, metrics = _train(model, table, algo, skip=True)
    assert metrics["train/inert_groups"] == 1
    # AdamW steps on a zero gradient as it would on the whole batch (its step count, moments).
    assert {int(s["step"]) for s in live.optimizer.state.values()} == {1}
    assert len(live.optimizer.state) == len(whole.optimizer.state)


def test_loss_counts_are_the_micro_batches_tokens_and_sequences(tok):
    _, table = _batch(tok, REWARDS)
    mbs = [mb for _, mb in table_micro_batches(table, 0, 12, ("advantages",))]
    assert len(mbs) > 1
    tokens = float(sum(mb.loss_mask.sum() for mb in mbs))
    seqs = float(sum((mb.loss_mask.sum(-1) > 0).sum() for mb in mbs))
    assert loss_counts(table) == (tokens, seqs)


@pytest.mark.parametrize("loss", sorted(POLICY_LOSSES))
@pytest.mark.parametrize(
    "settings",
    [
        LossSettings(),
        LossSettings(dual_clip=3.0, is_mode="tis", is_level="sequence"),
        LossSettings(is_mode="icepop", seq_mask="ratio"),
        LossSettings(is_mode="mis", is_level="geometric", seq_mask="kl", agg="dr_grpo", norm_len=5),
    ],
    ids=["plain", "dual-clip-tis", "icepop-opsm", "mis-dr-grpo"],
)
def test_every_policy_loss_gives_a_zero_advantage_row_no_gradient(loss, settings):
    """Why skipping is exact: each loss's per-token term is a multiple of the advantage."""
    g = torch.Generator().manual_seed(0)
    logprobs = (-torch.rand(4, 5, generator=g)).requires_grad_()
    advantages = torch.tensor([0.0, 0.0, 1.3, -0.7]).unsqueeze(1).expand(4, 5).contiguous()
    inputs = LossInputs(
        logprobs=logprobs,
        old_logprobs=logprobs.detach() + 0.1 * torch.randn(4, 5, generator=g),
        advantages=advantages,
        loss_mask=torch.ones(4, 5),
        rollout_logprobs=logprobs.detach() + 0.1 * torch.randn(4, 5, generator=g),
    )
    value, _ = POLICY_LOSSES[loss](inputs, settings, 20.0, 4.0)
    value.backward()
    assert torch.equal(logprobs.grad[:2], torch.zeros(2, 5))
    assert logprobs.grad[2:].abs().sum() > 0


def test_a_sliced_batch_finds_the_same_live_groups(tok):
    """A column sliced out of a bigger one indexes its buffer from an offset of its own: groups
    are read per row, not from the buffer's start."""
    _, table = _batch(tok, [[0, 0, 0, 0]] + REWARDS)
    sliced = table.slice(4)  # drops the first, inert group; offsets no longer start at 0
    assert sliced.column("advantages").chunk(0).offset > 0
    kept, left_out = live_groups(sliced)
    assert left_out == 2
    assert sorted(set(kept.column("group_id").to_pylist())) == ["e0-p1", "e0-p3"]


def test_rows_without_advantages_are_left_to_the_micro_batches_to_refuse(tok):
    _, table = _batch(tok, REWARDS)
    missing = table.set_column(
        table.schema.get_field_index("advantages"),
        "advantages",
        pa.array([None] * table.num_rows, type=table.schema.field("advantages").type),
    )
    assert live_groups(missing) == (missing, 0)
    with pytest.raises(ValueError, match="missing column 'advantages'"):
        train_on_table(TorchBackend(build_tiny_qwen3(SMALL, len(tok), seed=0), lr=1e-3), missing,
                       AlgorithmConfig(), 0, 4096, skip_inert=True)  # fmt: skip


def test_advantages_of_another_length_than_the_mask_name_the_row(tok):
    _, table = _batch(tok, REWARDS)
    adv = table.column("advantages").to_pylist()
    adv[5] = adv[5] + [0.0]
    bad = table.set_column(
        table.schema.get_field_index("advantages"),
        "advantages",
        pa.array(adv, type=table.schema.field("advantages").type),
    )
    uid = table.column("uid")[5].as_py()
    with pytest.raises(ValueError, match=f"row '{uid}': advantages and loss_mask differ"):
        live_groups(bad)
