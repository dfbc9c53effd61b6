"""Built-in rewards on hand-picked responses, user reward loading, and batch scoring that turns a
failing reward into a counted error instead of a crash."""

import logging
import math
from concurrent.futures import ThreadPoolExecutor

import pytest

from relax_core.rewards import REWARDS, RewardResult, resolve_reward, score_batch
from relax_core.rewards.choice import choice_reward
from relax_core.rewards.f1 import f1_reward, token_f1
from relax_core.rewards.math import math_reward

ROW = {"prompt": "p", "answer": "a", "meta": {}}
FIXTURES = "tests.unit.reward_fixtures"


# ---- math -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "answer", "extracted"),
    [
        ("46", "46", "46"),  # tiny arithmetic task: the response is just the number
        (" 46\n", "46", "46"),
        ("46.0", "46", "46.0"),
        ("1,234", "1234", "1,234"),
        ("-3", "-3", "-3"),
        ("7 + 5 = 12, so\nAnswer: 12", "12", "12"),
        ("Answer: 3\nwait, no.\nAnswer: 4", "4", "4"),  # the last Answer: line counts
        ("**Answer:** 4", "4", "4"),
        ("so the result is \\boxed{42}", "42", "42"),
        ("Answer: $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}", "\\frac{1}{2}"),
        ("Answer: 0.5", "\\frac{1}{2}", "0.5"),  # 0.5 == 1/2 via math-verify
        ("Answer: \\sqrt{8}", "2\\sqrt{2}", "\\sqrt{8}"),
    ],
)
def test_math_reward_accepts_equal_answers(response, answer, extracted):
    result = math_reward(response, answer, ROW)
    assert result == RewardResult(1.0, True, result.info)
    assert result.info["extracted"] == extracted


@pytest.mark.parametrize(
    ("response", "answer"),
    [
        ("45", "46"),
        ("1000001", "1000000"),  # integers compare exactly, no relative tolerance
        ("1,2", "12"),  # not a thousands separator
        ("Answer: 12\nAnswer: 13", "12"),  # the last Answer: line counts
        ("Answer: \\frac{5}{8}", "\\frac{3}{4}"),
        ("Answer: 2\\sqrt{3}", "2\\sqrt{2}"),  # bare LaTeX is parsed whole, not as "2"
        ("", "46"),
        ("   ", "46"),
        ("Answer:", "46"),
    ],
)
def test_math_reward_rejects_wrong_or_missing_answers(response, answer):
    result = math_reward(response, answer, ROW)
    assert (result.reward, result.correct) == (0.0, False)


def test_math_reward_is_safe_off_the_main_thread():
    # math-verify's default timeout uses signal.alarm, which raises outside the main thread.
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(math_reward, ["\\frac{2}{4}", "0.75"], ["1/2", "3/4"], [ROW] * 2))
    assert [r.correct for r in results] == [True, True]
    assert [r.info["method"] for r in results] == ["math_verify", "math_verify"]


# ---- multiple choice ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "extracted"),
    [
        ("C", "C"),
        ("C.", "C"),
        ("I think it is C because B is too small", "C"),  # first standalone valid letter
        ("The correct option is (C).", "C"),
        ("B looks tempting, but (C) is right", "C"),  # a parenthesised letter beats a bare one
        ("Options B and D fail.\nAnswer: C", "C"),  # the Answer: line beats everything
        ("answer: c", "C"),
        ("Answer: (c) since it is even", "C"),
    ],
)
def test_choice_reward_finds_the_letter(response, extracted):
    result = choice_reward(response, "c", ROW)
    assert result == RewardResult(1.0, True, {"extracted": extracted})


@pytest.mark.parametrize(
    ("response", "extracted"),
    [
        ("B", "B"),
        ("Answer: D", "D"),
        ("", ""),
        ("a cat is not an option", ""),  # lower-case "a" is the article
        ("F", ""),  # only A-E without a choices list
    ],
)
def test_choice_reward_rejects_other_or_missing_letters(response, extracted):
    assert choice_reward(response, "C", ROW) == RewardResult(0.0, False, {"extracted": extracted})


def test_choice_letters_follow_the_choices_list():
    row = {**ROW, "choices": ["w", "x", "y", "z", "v", "u", "t"]}  # seven choices: A-G
    assert choice_reward("Answer: G", "G", row).correct
    with pytest.raises(ValueError, match="one of the letters ABC"):
        choice_reward("C", "D", {**ROW, "choices": ["x", "y", "z"]})


# ---- f1 -------------------------------------------------------------------------------------


def test_f1_normalises_case_punctuation_and_articles():
    result = f1_reward("The Eiffel Tower!", "eiffel tower", ROW)
    assert result == RewardResult(1.0, True, {"extracted": "The Eiffel Tower!"})


def test_f1_partial_overlap():
    # prediction tokens [eiffel, tower, in, paris] vs gold [eiffel, tower]: overlap 2,
    # precision 2/4, recall 2/2, F1 = 2 * 0.5 * 1 / 1.5 = 2/3
    result = f1_reward("the Eiffel tower in Paris", "Eiffel Tower", ROW)
    assert result.reward == pytest.approx(2 / 3)
    assert result.correct is False


def test_f1_reads_the_answer_line_and_handles_empty():
    assert f1_reward("Let me think.\nAnswer: Paris", "paris", ROW).reward == 1.0
    assert f1_reward("", "paris", ROW) == RewardResult(0.0, False, {"extracted": ""})
    assert f1_reward("London", "paris", ROW).reward == 0.0
    # repeated tokens count once per gold occurrence: overlap min(3,1)=1, P=1/3, R=1, F1=0.5
    assert token_f1("paris paris paris", "paris") == pytest.approx(0.5)


# ---- registry and user functions ------------------------------------------------------------


def test_registered_names_resolve():
    assert set(REWARDS) == {"math", "digits", "multiple_choice", "f1"}
    assert resolve_reward("math") is math_reward
    assert resolve_reward("multiple_choice") is choice_reward


def test_user_function_resolves_and_scores():
    fn = resolve_reward(f"{FIXTURES}:length_reward")
    results, errors = score_batch(fn, ["abc", "abcdefg"], ["", ""], [ROW, ROW])
    assert errors == 0
    assert [r.reward for r in results] == [1.0, 0.0]
    assert results[1].info == {"length": 7}


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        (
            "mathh",
            ValueError,
            "registered rewards: digits, f1, math, multiple_choice.*module:function",
        ),
        ("", ValueError, "non-empty"),
        ("tests.unit.no_such_module:fn", ValueError, "'tests.unit.no_such_module' cannot be found"),
        (f"{FIXTURES}:missing", ValueError, "has no 'missing'"),
        (f"{FIXTURES}:", ValueError, "must be written 'module:function'"),
        (f"{FIXTURES}:NOT_A_FUNCTION", TypeError, "is a int, not a function"),
        (f"{FIXTURES}:two_args", TypeError, r"must accept \(response, answer, sample\)"),
    ],
)
def test_bad_reward_names_fail_with_a_clear_error(spec, error, message):
    with pytest.raises(error, match=message):
        resolve_reward(spec)


# ---- batch scoring --------------------------------------------------------------------------


def test_raising_user_function_is_counted_not_fatal(caplog):
    fn = resolve_reward(f"{FIXTURES}:raises_on_x")
    with caplog.at_level(logging.WARNING, logger="relax_core.rewards.scoring"):
        results, errors = score_batch(fn, ["ok", "x1", "x2"], ["", "", ""], [ROW] * 3)
    assert errors == 2
    assert results[0] == RewardResult(1.0, True, {})
    assert results[1] == RewardResult(0.0, False, {"error": "RuntimeError: cannot score 'x1'"})
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # once per batch, with the count and the first error
    assert "2 of 3" in warnings[0].getMessage()
    assert "cannot score 'x1'" in warnings[0].getMessage()


@pytest.mark.parametrize(
    ("name", "error"),
    [
        ("nan_reward", "ValueError: reward must be finite, got nan"),
        ("string_reward", "TypeError: reward must be a real number, got str"),
        ("returns_float", "TypeError: reward function returned float, not RewardResult"),
        ("unserialisable_info", "TypeError: Object of type object is not JSON serializable"),
    ],
)
def test_invalid_results_are_counted_as_errors(name, error):
    results, errors = score_batch(resolve_reward(f"{FIXTURES}:{name}"), ["r"], ["a"], [ROW])
    assert errors == 1
    assert results == [RewardResult(0.0, False, {"error": error})]


def test_score_batch_keeps_order_and_returns_plain_floats():
    results, errors = score_batch(math_reward, ["1", "2", "3"], ["1", "5", "3"], [ROW] * 3)
    assert errors == 0
    assert [r.correct for r in results] == [True, False, True]
    assert all(type(r.reward) is float and math.isfinite(r.reward) for r in results)


def test_score_batch_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 responses, 1 answers, 2 samples"):
        score_batch(math_reward, ["1", "2"], ["1"], [ROW, ROW])


@pytest.mark.parametrize(
    ("response", "answer", "reward", "correct"),
    [
        ("46", "46", 1.0, True),
        ("Answer: 46", "46", 1.0, True),
        ("47", "46", 0.25, False),  # ones digit wrong: 0.5 * 1/2 digits right
        ("146", "46", 0.5 * 2 / 3, False),  # '46' aligned from the right, 3 digits long
        ("64", "46", 0.0, False),
        ("forty-six", "46", 0.0, False),
    ],
)
def test_digits_reward_gives_partial_credit_below_any_exact_answer(
    response, answer, reward, correct
):
    result = resolve_reward("digits")(response, answer, {})
    assert result.reward == pytest.approx(reward) and result.correct is correct


@pytest.mark.parametrize(
    ("response", "correct"),
    [
        ("To add 8 and 2, add them together: 8 + 2 = 10.", True),
        ("8 + 2 = 10, or is it 11", False),  # the last number is the answer it commits to
        ("I have 1,010 apples", False),
        ("No idea.", False),
    ],
)
def test_math_reward_reads_the_last_number_of_a_wordy_response(response, correct):
    result = resolve_reward("math")(response, "10", {})
    assert result.correct is correct
    assert result.info["method"] == "last_number"
