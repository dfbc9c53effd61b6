"""What a person watching a local run sees: a progress bar per step and a summary at the end.

Both write to stderr, so stdout stays free for machine-readable output.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from typing import Self

from tqdm import tqdm

# (metric key, label in the bar); the few numbers that tell at a glance whether a run is learning.
_POSTFIX_KEYS = (
    ("train/reward_mean", "reward"),
    ("train/accuracy", "acc"),
    ("perf/tokens_per_s", "tok/s"),
)

SUMMARY_KEYS = (
    "eval_accuracy_before",
    "eval_accuracy_after",
    "steps",
    "wall_time_s",
    "mlflow_run_id",
    "mlflow_run_url",
    "mlflow_unsent",
    "checkpoint",
    "registered_model",
    "compare_url",
)


def format_rate(value: float) -> str:
    """A throughput in at most ~5 characters: 950 -> "950", 12345 -> "12.3k", 2.5e6 -> "2.5M"."""
    if not math.isfinite(value):
        return str(value)
    if abs(value) >= 1e6:
        return f"{value / 1e6:.1f}M"
    if abs(value) >= 1e3:
        return f"{value / 1e3:.1f}k"
    return f"{value:.0f}"


def format_postfix(metrics: Mapping[str, float]) -> str:
    """`reward=0.512 acc=0.420 tok/s=1.2k` from whichever of those metrics are present."""
    parts = []
    for key, label in _POSTFIX_KEYS:
        if key not in metrics:
            continue
        value = float(metrics[key])
        shown = format_rate(value) if key == "perf/tokens_per_s" else f"{value:.3f}"
        parts.append(f"{label}={shown}")
    return " ".join(parts)


class ProgressBar:
    """A tqdm bar over optimizer steps, on stderr; `start_step` > 0 when a run resumes."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True) -> None:
        if total_steps < 1:
            raise ValueError(f"ProgressBar: total_steps must be >= 1, got {total_steps}")
        if not 0 <= start_step <= total_steps:
            raise ValueError(
                f"ProgressBar: start_step must be in [0, {total_steps}], got {start_step}"
            )
        self._bar = tqdm(
            total=total_steps,
            initial=start_step,
            file=sys.stderr,
            disable=not enabled,
            unit="step",
            dynamic_ncols=True,
        )

    def update(self, step: int, metrics: Mapping[str, float]) -> None:
        """Show `step` steps done (not an increment) and the headline metrics of that step."""
        postfix = format_postfix(metrics)
        if postfix:
            self._bar.set_postfix_str(postfix, refresh=False)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)
        else:
            self._bar.refresh()

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def format_duration(seconds: float) -> str:
    """4.2 -> "4.2s", 125 -> "2m 05s", 3723 -> "1h 02m 03s"."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = round(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s"


def format_summary(summary: Mapping[str, object]) -> str:
    """A short end-of-run report; keys are SUMMARY_KEYS, each optional, unknown keys refused.

    eval_accuracy_before/after: floats in [0, 1]; wall_time_s: seconds; steps: int;
    mlflow_run_id / mlflow_run_url / checkpoint / registered_model / compare_url: strings;
    mlflow_unsent: spool files holding metrics the tracking server has not taken yet. A line
    whose values are absent is left out.
    """
    unknown = sorted(set(summary) - set(SUMMARY_KEYS))
    if unknown:
        raise ValueError(f"format_summary: unknown keys {unknown}; allowed: {list(SUMMARY_KEYS)}")
    rows = [
        ("eval accuracy", _accuracy_line(summary)),
        ("steps", _str_or_none(summary.get("steps"))),
        ("wall time", _duration_or_none(summary)),
        ("MLflow run", _mlflow_line(summary)),
        ("unsent", _unsent_line(summary.get("mlflow_unsent"))),
        ("checkpoint", _str_or_none(summary.get("checkpoint"))),
        ("model", _str_or_none(summary.get("registered_model"))),
        ("compare", _str_or_none(summary.get("compare_url"))),
    ]
    lines = ["Run summary"]
    lines += [f"  {label:<14}{text}" for label, text in rows if text]
    return "\n".join(lines)


def _accuracy_line(summary: Mapping[str, object]) -> str | None:
    before = _number(summary, "eval_accuracy_before")
    after = _number(summary, "eval_accuracy_after")
    if before is not None and after is not None:
        return f"{before:.3f} -> {after:.3f} ({after - before:+.3f})"
    if after is not None:
        return f"{after:.3f} (after training; no baseline eval)"
    if before is not None:
        return f"{before:.3f} (before training; no final eval)"
    return None


def _mlflow_line(summary: Mapping[str, object]) -> str | None:
    parts = [str(summary[k]) for k in ("mlflow_run_id", "mlflow_run_url") if summary.get(k)]
    return "  ".join(parts) or None


def _unsent_line(files: object) -> str | None:
    """The spool files (a path or a list of them) of metrics MLflow has not taken, one a line."""
    if not files:
        return None
    listed = [files] if isinstance(files, str) else files
    if not isinstance(listed, list | tuple):
        raise TypeError(f"format_summary: mlflow_unsent must be a path or a list, got {files!r}")
    head = (
        "metrics kept while the tracking server was down; sent when a run next starts on this "
        "storage, or by `relax send-metrics`:"
    )
    return "\n".join([head, *(f"{'':16}{f}" for f in listed)])


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _duration_or_none(summary: Mapping[str, object]) -> str | None:
    seconds = _number(summary, "wall_time_s")
    return None if seconds is None else format_duration(seconds)


def _number(summary: Mapping[str, object], key: str) -> float | None:
    value = summary.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"format_summary: {key} must be a number, got {value!r}")
    return float(value)
