"""Console progress bar and end-of-run summary, as a person at the terminal sees them."""

import pytest

from relax_core.tracking.console import (
    ProgressBar,
    format_duration,
    format_postfix,
    format_rate,
    format_summary,
)


def test_postfix_shows_reward_accuracy_and_throughput():
    metrics = {
        "train/reward_mean": 0.5123,
        "train/accuracy": 0.42,
        "perf/tokens_per_s": 12345.0,
        "train/loss": 3.0,  # not a headline metric: left out of the bar
    }
    assert format_postfix(metrics) == "reward=0.512 acc=0.420 tok/s=12.3k"
    assert format_postfix({"train/accuracy": 1.0}) == "acc=1.000"
    assert format_postfix({}) == ""


def test_rates_stay_short():
    assert format_rate(950.4) == "950"
    assert format_rate(12345.0) == "12.3k"  # 12345 / 1e3 = 12.345 -> 12.3
    assert format_rate(2.5e6) == "2.5M"
    assert format_rate(float("nan")) == "nan"


def test_progress_bar_writes_step_count_and_metrics_to_stderr(capsys):
    bar = ProgressBar(total_steps=20, start_step=5)
    for step in range(6, 11):
        bar.update(step, {"train/reward_mean": 0.25 * step, "perf/tokens_per_s": 800.0})
    bar.close()
    captured = capsys.readouterr()
    assert captured.out == ""
    final = captured.err.replace("\r", "\n").strip().splitlines()[-1]
    assert "10/20" in final  # resumed at 5, then 5 updates
    assert "reward=2.500" in final  # 0.25 * 10
    assert "tok/s=800" in final


def test_disabled_progress_bar_prints_nothing(capsys):
    with ProgressBar(total_steps=3, enabled=False) as bar:
        bar.update(1, {"train/reward_mean": 1.0})
    assert capsys.readouterr().err == ""


def test_progress_bar_rejects_bad_bounds():
    with pytest.raises(ValueError, match="total_steps"):
        ProgressBar(total_steps=0)
    with pytest.raises(ValueError, match="start_step"):
        ProgressBar(total_steps=5, start_step=6, enabled=False)


def test_durations_read_naturally():
    assert format_duration(4.25) == "4.2s"
    assert format_duration(125) == "2m 05s"  # 125 = 2*60 + 5
    assert format_duration(3723) == "1h 02m 03s"  # 3723 = 3600 + 2*60 + 3


def test_summary_has_accuracy_change_time_run_and_checkpoint():
    text = format_summary(
        {
            "eval_accuracy_before": 0.3125,
            "eval_accuracy_after": 0.5625,
            "steps": 50,
            "wall_time_s": 754.0,
            "mlflow_run_id": "abc123",
            "mlflow_run_url": "http://127.0.0.1:5000/#/experiments/1/runs/abc123",
            "checkpoint": "/runs/r1/ckpt/step-50",
        }
    )
    lines = text.splitlines()
    assert lines[0] == "Run summary"
    # 0.5625 - 0.3125 = +0.25
    assert lines[1].split() == ["eval", "accuracy", "0.312", "->", "0.562", "(+0.250)"]
    assert "12m 34s" in text  # 754 = 12*60 + 34
    assert "abc123  http://127.0.0.1:5000/#/experiments/1/runs/abc123" in text
    assert lines[-1].split() == ["checkpoint", "/runs/r1/ckpt/step-50"]


def test_summary_leaves_out_what_is_missing():
    text = format_summary({"eval_accuracy_after": 0.5, "wall_time_s": 3.0})
    assert text.splitlines() == [
        "Run summary",
        "  eval accuracy 0.500 (after training; no baseline eval)",
        "  wall time     3.0s",
    ]


def test_summary_refuses_unknown_keys_and_non_numbers():
    with pytest.raises(ValueError, match="eval_acc_after"):
        format_summary({"eval_acc_after": 0.5})
    with pytest.raises(TypeError, match="wall_time_s"):
        format_summary({"wall_time_s": "12 minutes"})
