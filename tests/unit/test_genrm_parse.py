"""GenRM pieces that need no model: reading a verdict from a judge's reply, checking a judge
template and the reward config, and `score_batch` calling a batch reward once per batch."""

import logging

import pytest

from relax_core.config import RewardConfig
from relax_core.rewards import RewardResult, resolve_reward, score_batch
from relax_core.rewards.genrm import DEFAULT_TEMPLATE, check_template, parse_verdict
from relax_core.rewards.registry import build_reward, check_reward

ROW = {"prompt": "What is 2 + 3?", "answer": "5", "meta": {}}

# ---- parse_verdict --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Verdict: correct",
        "Verdict: Correct.",
        "Verdict:correct",
        "VERDICT: CORRECT!",
        "Verdict: **correct**",
        "**Verdict:** correct",
        "verdict = correct",
        "Verdict: The student's answer is correct.",
        "Verdict: right",
        "Verdict: yes",
        "Verdict: True",
        "Verdict: 1",
        "Verdict: not wrong",
        "correct",
        "Correct. The student found 5.",
        "The answer is correct",
        "Yes, the student is right.",
        "Verdict: correct\nExplanation: a wrong answer would be 6.",
    ],
)
def test_correct_verdicts(text):
    assert parse_verdict(text) is True


@pytest.mark.parametrize(
    "text",
    [
        "Verdict: incorrect",
        "Verdict: Incorrect.",
        "VERDICT: INCORRECT",
        "Verdict: *incorrect*",
        "Verdict: wrong",
        "Verdict: no",
        "Verdict: false",
        "Verdict: 0",
        "Verdict: not correct",
        "Verdict: The answer isn't correct.",
        "Verdict: it is not right",
        "incorrect",
        "No. The reference says 5, the student says 7.",
        "The student's answer is wrong; it should be 5.",
        "Verdict: incorrect\nThe correct answer is 5.",
    ],
)
def test_incorrect_verdicts(text):
    assert parse_verdict(text) is False


@pytest.mark.parametrize(
    "text",
    [
        "",
        "Verdict:",
        "Verdict: ",
        "Verdict: 5",
        "The student wrote 7.",
        "Verdict: correct or incorrect",
        "Verdict: correct/incorrect",
        "Verdict: Correct / Incorrect",
        "I cannot tell.",
        # "no" and "true" decide only as the first word; inside a sentence they are explanation
        "There are no mistakes here",
        "It is true that 2 + 3 = 5",
    ],
)
def test_no_verdict_is_none(text):
    assert parse_verdict(text) is None


def test_first_verdict_tag_decides_over_earlier_words():
    # The text before the tag is a preamble; the tagged verdict is the answer.
    assert parse_verdict("This looks wrong at first. Verdict: correct") is True


# ---- templates and config -------------------------------------------------------------------


def test_empty_template_means_the_built_in_one():
    assert check_template("") == DEFAULT_TEMPLATE
    assert check_template("Judge {response} against {reference}.") == (
        "Judge {response} against {reference}."
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{question} {answer} {response}", "unknown field(s) ['answer']"),
        ("Is {reference} right?", "must contain {response}"),
        ("{response} {", "reward.judge_template"),
    ],
)
def test_bad_templates_name_the_field(template, message):
    with pytest.raises(ValueError, match="reward.judge_template") as info:
        check_template(template)
    assert message in str(info.value)


def test_genrm_passes_name_resolution_but_refuses_to_score_unbuilt():
    fn = resolve_reward("genrm")  # what config preflight does: must not fail
    results, errors = score_batch(fn, ["5"], ["5"], [ROW])
    assert errors == 1
    assert "build_reward" in results[0].info["error"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"judge_source": "gguf-package:no_such_judge_pkg"}, "reward.judge_source"),
        ({"judge_source": "/no/such/model/dir"}, "reward.judge_source"),
        ({"judge_template": "{answer}"}, "reward.judge_template"),
        ({"judge_batch_size": 0}, "reward.judge_batch_size"),
        ({"judge_max_new_tokens": 0}, "reward.judge_max_new_tokens"),
        ({"judge_timeout_s": 0.0}, "reward.judge_timeout_s"),
    ],
)
def test_check_reward_names_the_bad_judge_setting(overrides, message):
    cfg = RewardConfig(name="genrm", **overrides)
    with pytest.raises(ValueError, match=message):
        check_reward(cfg)
    with pytest.raises(ValueError, match=message):
        build_reward(cfg)  # fails before any model loading


def test_check_and_build_other_rewards_ignore_judge_settings():
    cfg = RewardConfig(name="math", judge_source="gguf-package:no_such_judge_pkg")
    check_reward(cfg)
    assert build_reward(cfg) is resolve_reward("math")


# ---- score_batch with a batch reward --------------------------------------------------------


class LengthJudge:
    """A batch reward: 1.0 for responses of at most 3 characters; counts its calls."""

    def __init__(self, fail_on: str = "") -> None:
        self.calls = 0
        self.fail_on = fail_on

    def score_many(self, responses, answers, samples):
        self.calls += 1
        out = []
        for r in responses:
            if self.fail_on and self.fail_on in r:
                out.append(RewardResult(0.0, False, {"error": "judge could not read it"}))
            else:
                out.append(RewardResult(float(len(r) <= 3), len(r) <= 3, {"n": len(r)}))
        return out

    def __call__(self, response, answer, sample):
        raise AssertionError("score_batch must use score_many for a batch reward")


def test_batch_reward_is_called_once_per_batch():
    judge = LengthJudge()
    results, errors = score_batch(judge, ["abc", "abcdef", "x"], ["", "", ""], [ROW] * 3)
    assert judge.calls == 1
    assert errors == 0
    assert [r.reward for r in results] == [1.0, 0.0, 1.0]
    assert [r.info for r in results] == [{"n": 3}, {"n": 6}, {"n": 1}]


def test_batch_reward_error_results_are_counted(caplog):
    judge = LengthJudge(fail_on="?")
    with caplog.at_level(logging.WARNING):
        results, errors = score_batch(judge, ["ab", "??", "abcd"], ["", "", ""], [ROW] * 3)
    assert errors == 1
    assert results[1] == RewardResult(0.0, False, {"error": "judge could not read it"})
    assert [results[0].reward, results[2].reward] == [1.0, 0.0]
    assert "LengthJudge failed on 1 of 3 samples" in caplog.text


class RaisingJudge:
    def score_many(self, responses, answers, samples):
        raise ConnectionError("judge server unreachable")


class ShortJudge:
    def score_many(self, responses, answers, samples):
        return [RewardResult(1.0, True, {})]


class NanJudge:
    def score_many(self, responses, answers, samples):
        return [RewardResult(float("nan"), False, {}), RewardResult(1.0, True, {})]


@pytest.mark.parametrize(
    ("judge", "error"),
    [
        (RaisingJudge(), "ConnectionError: judge server unreachable"),
        (ShortJudge(), "ValueError: score_many returned 1 results for 2 responses"),
    ],
)
def test_a_failing_batch_costs_every_sample_of_the_batch(judge, error):
    results, errors = score_batch(judge, ["a", "b"], ["", ""], [ROW] * 2)
    assert errors == 2
    assert results == [RewardResult(0.0, False, {"error": error})] * 2


def test_an_invalid_batch_result_costs_only_its_sample():
    results, errors = score_batch(NanJudge(), ["a", "b"], ["", ""], [ROW] * 2)
    assert errors == 1
    assert results[0].reward == 0.0 and "finite" in results[0].info["error"]
    assert results[1] == RewardResult(1.0, True, {})


def test_batch_reward_keeps_the_length_check():
    with pytest.raises(ValueError, match="one answer and one sample per response"):
        score_batch(LengthJudge(), ["a", "b"], [""], [ROW, ROW])
