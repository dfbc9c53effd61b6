"""The `env` section of a run config: its validation, preflight of the env itself, the shipped
agentic datasets, and the warm start on demonstration episodes (loss on model turns only)."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

from relax_core.config import ConfigError, load_config, replace
from relax_core.data.dataset import load_prompts
from relax_core.envs import resolve_env
from relax_core.models.tiny import build_char_tokenizer
from relax_core.roles.episodes import check_env, env_runner, response_budget
from relax_core.rollout.observations import ObservationRenderer
from relax_core.run.prepare import PolicySpec, demonstration_examples

REPO = Path(__file__).resolve().parents[2]
AGENTIC = str(REPO / "configs" / "cpu-agentic.yaml")
DEFAULT = str(REPO / "configs" / "cpu-default.yaml")


def _agentic(**sections):
    return replace(load_config(AGENTIC), **sections)


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"env": {"max_turns": 0}}, "env.max_turns: must be > 0, got 0"),
        (
            {"env": {"max_episode_tokens": 8}},
            "env.max_episode_tokens: 8 is below rollout.max_new_tokens (16)",
        ),
        ({"env": {"max_episode_tokens": 600}}, "the tiny model's 512 positions"),
        ({"reward": {"overlong_buffer": 64}}, "below env.max_episode_tokens (64)"),
        ({"env": {"name": "", "kwargs": {"a": "1"}}}, "env.kwargs: set, but env.name is empty"),
        ({"env": {"kwargs": "x"}}, "env.kwargs: expected a mapping"),
    ],
)
def test_env_limits_are_validated_with_the_field_named(sections, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        _agentic(**sections)


def test_an_overlong_buffer_counts_against_the_episode_budget():
    cfg = _agentic(reward={"overlong_buffer": 20})  # above max_new_tokens, below the episode's
    assert cfg.reward.overlong_buffer == 20
    assert response_budget(cfg) == 64
    assert response_budget(load_config(DEFAULT)) == load_config(DEFAULT).rollout.max_new_tokens


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("maze", "env.name: unknown env 'maze'; shipped envs: calculator, guess_number"),
        ("no_such_pkg.envs:Maze", "env.name: env 'no_such_pkg.envs:Maze': module"),
        ("relax_core.envs.calculator:generate", "env.name: env 'relax_core.envs.calculator"),
    ],
)
def test_preflight_names_an_env_that_cannot_be_built(name, expected):
    problems = check_env(_agentic(env={"name": name}, warm_start={"steps": 0}))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_preflight_refuses_bad_env_kwargs_and_a_warm_start_without_demonstrations():
    assert "env.name: env " in check_env(_agentic(env={"kwargs": {"bogus": "1"}}))[0]
    user_env = "relax_core.envs.calculator:CalculatorEnv"
    problems = check_env(_agentic(env={"name": user_env}))
    assert problems and problems[0].startswith("warm_start.steps: env ")
    assert check_env(_agentic(env={"name": user_env}, warm_start={"steps": 0})) == []
    assert check_env(load_config(AGENTIC)) == []


def test_preflight_refuses_prompts_that_leave_no_room_for_an_episode(tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt": "%s", "answer": "1"}\n' % ("x" * 480))
    problems = check_env(_agentic(data={"train_path": str(long)}, env={"max_episode_tokens": 40}))
    assert problems == [
        "env.max_episode_tokens: the longest prompt of data.train_path (480 tokens) plus 40 "
        "exceeds the tiny model's 512 positions"
    ]


def test_the_policy_cache_key_covers_the_env_only_for_agentic_runs():
    base = load_config(DEFAULT)
    spec = PolicySpec.of(base, "fp")
    assert PolicySpec.from_json(spec.to_json()) == spec
    agentic = PolicySpec.of(load_config(AGENTIC), "fp")
    assert PolicySpec.from_json(agentic.to_json()) == agentic
    longer = PolicySpec.of(_agentic(env={"max_turns": 2}), "fp")
    assert longer.key() != agentic.key()
    # A single-turn spec's key ignores the (empty) env, so cached policies stay valid.
    same = PolicySpec(spec.model, spec.warm_start, spec.data, spec.seed, "fp")
    assert same.key() == spec.key()


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(
        f"_relax_{name}", REPO / "datasets" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("name", "sizes"), [("calculator", (2000, 128)), ("guess_number", (1024, 64))]
)
def test_shipped_agentic_datasets_match_their_generators(tmp_path, name, sizes):
    _load_script(name).main(["--out", str(tmp_path)])
    for split, size in zip(("train", "eval"), sizes, strict=True):
        shipped = REPO / "datasets" / name / f"{split}.jsonl"
        assert shipped.read_bytes() == (tmp_path / f"{split}.jsonl").read_bytes(), split
        assert len(load_prompts(str(shipped))) == size
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp-")]


def test_warm_start_examples_train_the_model_turns_of_accepted_demonstrations():
    cfg = PolicySpec.of(load_config(AGENTIC))
    tok = build_char_tokenizer()
    rows = [
        {"prompt": "What is 123*45?\n", "answer": "5535", "meta": {"expression": "123*45"}},
        {"prompt": "What is 999*99?\n", "answer": "98901", "meta": {"expression": "999*99"}},
    ]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    examples, media = demonstration_examples(cfg, None, tok, rows, prompts, None)
    assert media is None and len(examples) == 2
    prompt_ids, response, mask = examples[0]
    assert prompt_ids == prompts[0]
    eos = tok.eos_token_id
    turn1 = tok("calc(123*45)", add_special_tokens=False)["input_ids"] + [eos]
    obs = tok("\ntool: 5535\n", add_special_tokens=False)["input_ids"]
    turn2 = tok("Answer: 5535", add_special_tokens=False)["input_ids"] + [eos]
    assert response == turn1 + obs + turn2
    assert mask == [1] * len(turn1) + [0] * len(obs) + [1] * len(turn2)
    # A budget too small for the second turn cuts every demonstration: refused, field named.
    tight = PolicySpec.of(_agentic(env={"max_episode_tokens": 30}))
    with pytest.raises(ValueError, match="warm_start.steps: no demonstration"):
        demonstration_examples(tight, None, tok, rows, prompts, None)


def test_an_env_runner_exists_only_for_agentic_runs():
    tok = build_char_tokenizer()
    assert env_runner(load_config(DEFAULT), None, tok) is None
    runner = env_runner(load_config(AGENTIC), None, tok)
    assert runner.limits.max_turns == 3 and runner.limits.max_episode_tokens == 64
    assert isinstance(runner.render, ObservationRenderer)
    assert type(runner.env_factory()) is type(resolve_env("calculator")())


AGENT = str(REPO / "configs" / "cpu-agent.yaml")


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"env": {"name": "calculator"}}, "env.agent: set together with env.name"),
        ({"env": {"agent_workers": 0}}, "env.agent_workers: must be > 0"),
        ({"env": {"agent_timeout_s": 0}}, "env.agent_timeout_s: must be > 0"),
        ({"env": {"kwargs": {"a": "1"}}}, "an agent takes no env kwargs"),
        ({"env": {"max_turns": 0}}, "env.max_turns: must be > 0, got 0"),
    ],
)
def test_agent_settings_are_validated_with_the_field_named(sections, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        replace(load_config(AGENT), **sections)


@pytest.mark.parametrize(
    ("agent", "expected"),
    [
        ("examples.agents.nope:solve", "cannot be found"),
        ("examples.agents.calculator_agent:missing", "has no 'missing'"),
        ("examples.agents.calculator_agent:MAX_TURNS", "not a function"),
        ("examples.agents.calculator_agent:calculate", "must accept (sample, *, base_url"),
    ],
)
def test_preflight_names_an_agent_that_cannot_be_called(agent, expected):
    cfg = replace(load_config(AGENT), env={"agent": agent})
    problems = check_env(cfg)
    assert len(problems) == 1 and expected in problems[0], problems


def test_an_agent_run_gets_an_agent_runner_and_the_episode_budget():
    cfg = load_config(AGENT)
    tok = build_char_tokenizer()
    runner = env_runner(cfg, None, tok)
    assert type(runner).__name__ == "AgentRunner" and runner.limits.max_calls == 4
    assert response_budget(cfg) == 96 and check_env(cfg) == []
