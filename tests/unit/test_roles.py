"""The role functions on real queue rows: advantages per group, mini-batch updates, rollout rows."""

from __future__ import annotations

import pytest
import torch

from relax_core.config import AlgorithmConfig, ModelConfig
from relax_core.data.prompts import PromptItem
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.queue import rows_to_table
from relax_core.rewards import resolve_reward
from relax_core.roles.advantages import add_advantages
from relax_core.roles.rollout import rollout_groups
from relax_core.roles.trainer import _split_groups, train_on_table
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.torch_backend import TorchBackend

SMALL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _rows(tok, n_groups=4, n=4):
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    items = [
        PromptItem(
            0,
            i,
            {"prompt": f"{i}+{i}=", "answer": str(2 * i)},
            tok(f"{i}+{i}=", add_special_tokens=False)["input_ids"],
        )
        for i in range(n_groups)
    ]
    rows, metrics = rollout_groups(
        engine, tok, items, SamplingParams(max_new_tokens=3), n, resolve_reward("math")
    )
    return model, rows, metrics


def test_rollout_rows_are_whole_groups_with_versions_and_masks(tok):
    _, rows, metrics = _rows(tok)
    table = rows_to_table(rows)
    assert table.num_rows == 16
    assert sorted(set(table.column("group_id").to_pylist())) == ["e0-p0", "e0-p1", "e0-p2", "e0-p3"]
    for r in rows:
        assert len(r["loss_mask"]) == len(r["response_ids"]) == len(r["rollout_logprobs"])
        assert r["behaviour_version_min"] == r["behaviour_version_max"] == 0
    assert metrics["train/reward_mean"] == pytest.approx(sum(r["reward"] for r in rows) / 16)


def test_advantages_are_normalized_within_each_group(tok):
    _, rows, _ = _rows(tok)
    # Make group e0-p0 rewards [1, 0, 0, 0]: mean 0.25, std sqrt(0.1875) = 0.4330
    for j, r in enumerate(rows[:4]):
        r["reward"] = 1.0 if j == 0 else 0.0
    for r in rows[4:]:
        r["reward"] = 0.0  # all-equal groups carry no signal
    table = add_advantages(rows_to_table(rows), "grpo", normalize_std=True)
    adv = table.column("advantages").to_pylist()
    assert adv[0][0] == pytest.approx(0.75 / 0.4330127, rel=1e-4)
    assert adv[1][0] == pytest.approx(-0.25 / 0.4330127, rel=1e-4)
    assert all(len(a) == len(r["response_ids"]) for a, r in zip(adv, rows, strict=True))
    assert all(v == 0.0 for a in adv[4:] for v in a)


def test_mini_batches_keep_groups_whole_and_step_the_optimizer_each_time(tok):
    model, rows, _ = _rows(tok)
    for k, r in enumerate(rows):
        r["reward"] = float(k % 2)
    table = add_advantages(rows_to_table(rows), "grpo", normalize_std=True)
    parts = _split_groups(table, 2)
    assert [sorted(set(p.column("group_id").to_pylist())) for p in parts] == [
        ["e0-p0", "e0-p1"],
        ["e0-p2", "e0-p3"],
    ]
    backend = TorchBackend(model, lr=1e-3)
    algo = AlgorithmConfig()
    metrics = train_on_table(backend, table, algo, tok.pad_token_id, 4096, minibatches=2)
    steps = {int(s["step"]) for s in backend.optimizer.state.values()}
    assert steps == {2}
    # Every token of every group is trained exactly once across the two updates.
    assert metrics["train/trained_tokens"] == sum(len(r["response_ids"]) for r in rows)
    assert torch.isfinite(torch.tensor(metrics["train/grad_norm"]))
