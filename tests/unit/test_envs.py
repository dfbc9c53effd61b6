"""Agentic envs: the safe calculator, the two example envs, their datasets and demonstrations,
and loading a user's env from 'module:Class' with errors that name it."""

from __future__ import annotations

import textwrap
from fractions import Fraction

import pytest

from relax_core.envs import (
    DEMONSTRATIONS,
    ENVS,
    StepResult,
    as_step_result,
    calculator,
    guess_number,
    load_env,
    resolve_env,
)
from relax_core.envs.arith import CalcError, Limits, evaluate, format_number
from relax_core.models.tiny import build_char_tokenizer
from relax_core.rollout.demonstrations import demonstration_episode
from relax_core.rollout.multiturn import EpisodeLimits
from relax_core.rollout.observations import ObservationRenderer

# ---------------------------------------------------------------------------- arithmetic


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*45", Fraction(5535)),
        ("2+3*4", Fraction(14)),  # * binds tighter than +
        ("(2+3)*4", Fraction(20)),
        ("10-4-3", Fraction(3)),  # left-associative: (10-4)-3, not 10-(4-3)=9
        ("-3*-2", Fraction(6)),
        ("7/2", Fraction(7, 2)),
        ("1.5*4", Fraction(6)),
        (" 12 + 30 ", Fraction(42)),
    ],
)
def test_evaluate_follows_arithmetic_rules(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("1/0", "division by zero"),
        ("5/(3-3)", "division by zero"),
        ("1234567890123*2", "number too large"),  # 13 digits > 12
        ("999999999999*999999999999", "number too large"),  # ~1e24 > 1e15
        ("1+" * 40 + "1", "expression too long"),
        ("(" * 20 + "1" + ")" * 20, "expression too deep"),
        ("-" * 30 + "1", "expression too deep"),
        ("", "empty expression"),
        ("1+", "bad expression"),
        ("(1+2", "bad expression"),
        ("1+2)", "bad expression"),
        ("1..2", "bad expression"),
        ("2**3", "bad expression"),  # no power operator: it is how huge numbers are made
        ("1e5", "bad expression"),
        ("__import__", "bad expression"),
        ("2\u00b2", "bad expression"),  # '²' passes str.isdigit
    ],
)
def test_evaluate_refuses_malformed_and_unbounded_input(expression, reason):
    with pytest.raises(CalcError) as err:
        evaluate(expression)
    assert err.value.reason == reason


def test_limits_are_settable():
    assert evaluate("99*99", Limits(max_abs=10**4)) == 9801
    with pytest.raises(CalcError, match="number too large"):
        evaluate("102*99", Limits(max_abs=10**4))  # 10098


def test_format_number():
    assert format_number(Fraction(5535)) == "5535"
    assert format_number(Fraction(-7, 2)) == "-3.5"
    assert format_number(Fraction(1, 3)) == "0.333333"
    assert format_number(Fraction(1, 10**7)) == "0"


# ---------------------------------------------------------------------------- calculator env


def _calc_env(answer="5535"):
    env = calculator.CalculatorEnv()
    assert env.reset({"prompt": "What is 123*45?\n", "answer": answer}) is None
    return env


def test_calculator_tool_call_returns_the_value_and_continues():
    result = _calc_env().step("calc(123*45)")
    assert result == StepResult("5535", 0.0, False, result.info)
    assert result.info["tool_call_valid"] is True


@pytest.mark.parametrize(
    ("turn", "observation"),
    [
        ("calc(1/0)", "error: division by zero"),
        ("calc(99999999999999*2)", "error: number too large"),
        ("calc(12*", "error: bad expression"),  # an unclosed call is a (bad) call, not an answer
        ("calc()", "error: empty expression"),
        ("calc(import os)", "error: bad expression"),
    ],
)
def test_calculator_invalid_tool_calls_answer_an_error_and_continue(turn, observation):
    result = _calc_env().step(turn)
    assert (result.observation, result.reward, result.done) == (observation, 0.0, False)
    assert result.info["tool_call_valid"] is False


def test_calculator_final_answer_is_scored():
    right = _calc_env().step("Answer: 5535")
    wrong = _calc_env().step("Answer: 5536")
    silent = _calc_env().step("I do not know")
    assert (right.reward, right.done, right.info["correct"]) == (1.0, True, True)
    assert (wrong.reward, wrong.done, wrong.info["correct"]) == (0.0, True, False)
    assert (silent.reward, silent.done, silent.info["answer"]) == (0.0, True, None)
    assert "tool_call_valid" not in right.info  # a final answer is no tool call
    assert _calc_env().format_observation("5535") == {"role": "tool", "content": "5535"}


def test_calculator_step_before_reset_is_an_error():
    with pytest.raises(RuntimeError, match="reset"):
        calculator.CalculatorEnv().step("Answer: 1")


# ---------------------------------------------------------------------------- guess the number


def _guess_env(target=11, **kwargs):
    env = guess_number.GuessNumberEnv(**kwargs)
    env.reset({"prompt": guess_number.prompt_for(16), "answer": str(target), "meta": {"high": 16}})
    return env


def test_guess_feedback_and_shaped_reward():
    env = _guess_env(11)
    assert env.step("Guess: 8")[:3] == ("higher", 0.0, False)
    assert env.step("Guess: 12")[:3] == ("lower", 0.0, False)
    assert env.step("Guess 10")[:3] == ("invalid", 0.0, False)  # no colon: not the format
    assert env.step("Guess: 17")[:3] == ("invalid", 0.0, False)  # outside 1..16
    done = env.step("Guess: 11")
    # Fifth guess: 1 - 0.1 * (5 - 1) = 0.6.
    assert (done.reward, done.done, done.info["correct"]) == (pytest.approx(0.6), True, True)
    assert env.format_observation("higher") == {"role": "user", "content": "higher"}


def test_guess_ends_after_max_guesses_and_takes_string_kwargs():
    env = _guess_env(3, max_guesses="2", turn_penalty="0.25")  # config kwargs are strings
    assert env.step("Guess: 8").done is False
    last = env.step("Guess: 4")
    assert (last.reward, last.done, last.info["correct"]) == (0.0, True, False)
    assert _guess_env(5, turn_penalty="0.25").step("Guess: 5").reward == 1.0
    with pytest.raises(ValueError, match="max_guesses"):
        guess_number.GuessNumberEnv(max_guesses=0)


def test_guess_reset_refuses_an_answer_outside_the_range():
    with pytest.raises(ValueError, match="outside"):
        _guess_env(17)


# ---------------------------------------------------------------------------- datasets, demos


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.mark.parametrize("module", [calculator, guess_number])
def test_datasets_are_deterministic_and_tokenize_without_unknowns(module, tok):
    train, eval_ = module.generate(seed=3)
    assert (train, eval_) == module.generate(seed=3)
    assert train != module.generate(seed=4)[0]
    unk = tok.unk_token_id
    for row in train[:200] + eval_:
        assert set(row) == {"prompt", "answer", "meta"}
        assert unk not in tok(row["prompt"], add_special_tokens=False)["input_ids"]
        for turn in module.demonstration(row):
            assert unk not in tok(turn, add_special_tokens=False)["input_ids"]


def test_calculator_dataset_splits_are_disjoint_and_hard():
    train, eval_ = calculator.generate()
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_}
    for row in eval_:
        a, b = map(int, row["meta"]["expression"].split("*"))
        assert 100 <= a <= 999 and 10 <= b <= 99 and row["answer"] == str(a * b)


def test_guess_eval_split_covers_every_target_equally():
    _, eval_ = guess_number.generate(high=16, eval_size=64)
    counts = {t: sum(r["answer"] == str(t) for r in eval_) for t in range(1, 17)}
    assert set(counts.values()) == {4}


@pytest.mark.parametrize(
    ("name", "module"), [("calculator", calculator), ("guess_number", guess_number)]
)
def test_demonstrations_solve_their_env(name, module, tok):
    render = ObservationRenderer(tok, "plain")
    limits = EpisodeLimits(max_turns=6, max_episode_tokens=256)
    factory = resolve_env(name)
    for row in module.generate(eval_size=32)[1]:
        ids = tok(row["prompt"], add_special_tokens=False)["input_ids"]
        ep = demonstration_episode(
            tok, factory, row, ids, module.demonstration(row), limits, render
        )
        assert (ep.end_reason, ep.correct) == ("done", True)
        assert ep.reward > 0


# ---------------------------------------------------------------------------- loading user envs


@pytest.fixture
def user_envs(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(
        textwrap.dedent(
            """
            class Good:
                def __init__(self, size=3):
                    self.size = int(size)
                def reset(self, sample):
                    return None
                def step(self, action_text):
                    return ("ok", 0.0, True, {})
                def format_observation(self, observation):
                    return {"role": "user", "content": str(observation)}

            class NoStep:
                def reset(self, sample):
                    return None
                format_observation = None

            class Picky:
                def __init__(self):
                    raise RuntimeError("needs a GPU")

            NOT_A_CLASS = 42
            """
        )
    )
    (tmp_path / "broken_envs.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_load_env_builds_fresh_envs_with_kwargs(user_envs):
    factory = load_env("my_envs:Good", size="5")
    a, b = factory(), factory()
    assert a is not b and a.size == 5


@pytest.mark.parametrize(
    ("spec", "kwargs", "error", "message"),
    [
        ("my_envs.Good", {}, ValueError, "must be written 'module:Class'"),
        ("no_such_module_xyz:Env", {}, ValueError, "cannot be found"),
        ("broken_envs:Env", {}, ValueError, "importing 'broken_envs' failed"),
        ("my_envs:Missing", {}, ValueError, "has no 'Missing'"),
        ("my_envs:NOT_A_CLASS", {}, TypeError, "not a class"),
        ("my_envs:NoStep", {}, TypeError, "missing method\\(s\\) step, format_observation"),
        ("my_envs:Good", {"colour": "red"}, TypeError, "keyword arguments \\['colour'\\]"),
        ("my_envs:Picky", {}, ValueError, "RuntimeError: needs a GPU"),
    ],
)
def test_load_env_errors_name_the_spec(user_envs, spec, kwargs, error, message):
    with pytest.raises(error, match=message) as err:
        load_env(spec, **kwargs)
    assert repr(spec) in str(err.value)


def test_resolve_env_knows_the_shipped_envs_and_user_specs(user_envs):
    assert isinstance(resolve_env("calculator")(), calculator.CalculatorEnv)
    assert resolve_env("guess_number", max_guesses="4")().max_guesses == 4
    assert resolve_env("my_envs:Good")().size == 3
    with pytest.raises(ValueError, match="shipped envs: calculator, guess_number"):
        resolve_env("maze")
    assert set(ENVS) == {"calculator", "guess_number", "openenv"}
    assert set(DEMONSTRATIONS) == {"calculator", "guess_number"}


# ---------------------------------------------------------------------------- step results


def test_as_step_result_accepts_tuples_and_refuses_malformed_results():
    assert as_step_result(("o", 1, False, None)) == StepResult("o", 1.0, False, {})
    for bad, message in [
        (("o", 1.0, False), "4-tuple"),
        ("o", "4-tuple"),
        (("o", "1.0", False, {}), "reward must be a number"),
        (("o", float("nan"), False, {}), "finite"),
        (("o", 1.0, "yes", {}), "done must be a bool"),
        (("o", 1.0, True, ["x"]), "info must be a dict"),
    ]:
        with pytest.raises((TypeError, ValueError), match=message):
            as_step_result(bad)
