"""The run report (Flyte Deck of `finish_run`) from a real MLflow store: curves, the staleness
histogram over the run, the time per role, and the run's link."""

from __future__ import annotations

import base64
import re
import time

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from relax_core.tracking.report import run_report_html


def _run(tmp_path, mode: str, per_step: dict[str, list[float]]) -> tuple[str, str]:
    uri = f"sqlite:///{tmp_path}/m.db"
    client = MlflowClient(uri)
    exp = client.create_experiment(f"report-{mode}")
    run = client.create_run(exp, tags={"relax.mode": mode, "relax.run_id": f"r-{mode}"})
    now = int(time.time() * 1000)
    metrics = [
        Metric(key, value, now, step)
        for key, values in per_step.items()
        for step, value in enumerate(values, start=1)
    ]
    metrics += [Metric("eval/accuracy", 0.2, now, 0), Metric("eval/accuracy", 0.6, now, 3)]
    client.log_batch(run.info.run_id, metrics=metrics)
    return uri, run.info.run_id


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r"base64,([A-Za-z0-9+/=]+)", page)]


def _rows(page: str, cls: str) -> list[list[str]]:
    table = re.search(rf'<table class="{cls}">(.*?)</table>', page).group(1)
    return [re.findall(r"<td>(.*?)</td>", row) for row in re.findall(r"<tr>(.*?)</tr>", table)][1:]


def test_async_run_report_sums_the_staleness_histogram_and_shows_both_roles(tmp_path):
    uri, run_id = _run(
        tmp_path,
        "async",
        {
            "train/reward_mean": [0.1, 0.2, 0.3],
            "train/accuracy": [0.1, 0.25, 0.3],
            "train/staleness_hist_0": [32, 0, 0],
            "train/staleness_hist_1": [0, 30, 32],
            "train/staleness_hist_2": [0, 2, 0],
            "perf/train_s": [0.2, 0.3, 0.25],
            "perf/sync_s": [0.01, 0.01, 0.01],
            "perf/trainer_wait_s": [0.5, 0.0, 0.002],
            "perf/generate_s": [0.12, 0.13, 0.11],
            "perf/rollout_wait_s": [0.1, 0.2, 0.15],
        },
    )
    page = run_report_html(uri, run_id)
    for section in ("header", "curves", "staleness", "timing"):
        assert f'<section id="{section}">' in page
    images = _images(page)
    assert len(images) == 3 and all(i.startswith(b"\x89PNG") for i in images)
    assert _rows(page, "staleness") == [["0", "32"], ["1", "62"], ["2", "2"]]
    timing = {(role, phase): float(v) for role, phase, v in _rows(page, "timing")}
    assert timing[("trainer", "train")] == 0.25  # medians per step
    assert timing[("trainer", "wait for data")] == 0.002
    assert timing[("rollout", "generate")] == 0.12
    assert ("rollout", "reward") not in timing  # not logged, not invented
    assert f"runs/{run_id}" in page and "0.600 (step 3)" in page


def test_colocate_run_report_without_a_histogram_counts_steps_by_max_staleness(tmp_path):
    uri, run_id = _run(
        tmp_path,
        "colocate",
        {
            "train/reward_mean": [0.1, 0.2],
            "train/staleness_max": [0.0, 0.0],
            "perf/rollout_s": [0.08, 0.09],
            "perf/train_s": [0.17, 0.19],
        },
    )
    page = run_report_html(uri, run_id)
    assert _rows(page, "staleness") == [["0", "2"]]
    roles = {role for role, _, _ in _rows(page, "timing")}
    assert roles == {"controller"}
