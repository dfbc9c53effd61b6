"""The rollout of an agentic run (roles/episodes.py): groups of episodes become queue rows
that keep each episode's masks, rewards and failures, with the rollout's episode metrics."""

from __future__ import annotations

import json

import pytest

from relax_core.data.prompts import PromptItem
from relax_core.models.tiny import build_char_tokenizer
from relax_core.queue import rows_to_table
from relax_core.roles.episodes import EnvRunner
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.multiturn import EpisodeLimits
from relax_core.rollout.observations import ObservationRenderer
from tests.unit.test_multiturn import ScriptedEngine, ScriptEnv, ids_of, obs_ids, sample


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _runner(tok, buffer: int = 0) -> EnvRunner:
    render = ObservationRenderer(tok, "plain")
    return EnvRunner(ScriptEnv, EpisodeLimits(3, 40), render, tok, buffer, 1.0)


def test_episodes_become_rows_of_whole_groups_with_their_masks_and_failures(tok):
    rows_in = [sample("A\n", done_after=2), sample("B\n", done_after=3, fail="step")]
    items = [PromptItem(1, i, row, ids_of(tok, row["prompt"])) for i, row in enumerate(rows_in)]
    scripts = {"A\n": [("ab", "stop", 3)] * 4, "B\n": [("c", "stop", 3)] * 4}
    engine = ScriptedEngine(tok, scripts)
    engine.version = 3
    rows, metrics = _runner(tok).rollout(engine, items, SamplingParams(max_new_tokens=8), 2)
    assert [r["uid"] for r in rows] == ["e1-p0-s0", "e1-p0-s1", "e1-p1-s0", "e1-p1-s1"]
    assert [r["group_id"] for r in rows] == ["e1-p0"] * 2 + ["e1-p1"] * 2
    eos = tok.eos_token_id
    turn = ids_of(tok, "ab") + [eos]
    a = rows[0]
    assert a["response_ids"] == turn + obs_ids(tok, 1) + turn
    assert a["loss_mask"] == [1] * 3 + [0] * len(obs_ids(tok, 1)) + [1] * 3
    assert (a["turns"], a["reward"], a["finish_reason"]) == (2, 1.0, "stop")
    assert a["reward_info"]["correct"] is True and a["behaviour_version_min"] == 3
    b = rows[2]
    assert b["finish_reason"] == "abort" and b["reward_info"]["env_error"]["phase"] == "step"
    assert rows_to_table(rows).num_rows == 4  # every episode, failed or not, is a valid row
    assert metrics["train/accuracy"] == 0.5
    assert metrics["rollout/success_rate"] == 0.5
    assert metrics["rollout/mean_turns"] == 2.0
    assert metrics["rollout/env_errors"] == 2.0
    assert metrics["perf/generated_tokens"] == 2 * 6 + 2 * 4


def test_the_overlong_penalty_counts_against_the_episode_budget(tok):
    row = sample("A\n", done_after=2)
    items = [PromptItem(0, 0, row, ids_of(tok, "A\n"))]
    engine = ScriptedEngine(tok, {"A\n": [("abcdefghijklmno", "stop", 0)] * 4})
    rows, _ = _runner(tok, buffer=30).rollout(engine, items, SamplingParams(16), 2)
    # A 16-token turn, an 11-token observation, and the second turn cut at the 40-token budget.
    length = len(rows[0]["response_ids"])
    assert length == 40 and rows[0]["finish_reason"] == "length"
    assert rows[0]["reward_info"]["end_reason"] == "token_budget"
    penalty = (length - (40 - 30)) / 30
    assert rows[0]["reward_info"]["overlong_penalty"] == penalty
    assert json.dumps(rows[0]["reward_info"])
