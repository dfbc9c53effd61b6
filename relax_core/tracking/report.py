"""A training run's report as one self-contained HTML page (the Flyte Deck of the run).

Read from the run's MLflow metrics: reward and accuracy curves, the staleness histogram over the
whole run, the time per step of each role, and the link to the MLflow run. Plots are PNGs inlined
as base64 (matplotlib's object API, no global pyplot state); every plotted number that a person
may want to copy is also in a small table next to its plot.
"""

from __future__ import annotations

import base64
import html
import io
import re
import statistics

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from mlflow.tracking import MlflowClient

_HIST = re.compile(r"^train/staleness_hist_(\d+)$")
_PHASES = {
    "colocate": {
        "controller": [
            ("rollout", "perf/rollout_s"),
            ("reference", "perf/ref_s"),
            ("train", "perf/train_s"),
            ("weight sync", "perf/sync_s"),
            ("queue", "perf/queue_s"),
        ]
    },
    "async": {
        "trainer": [
            ("train", "perf/train_s"),
            ("weight sync", "perf/sync_s"),
            ("wait for data", "perf/trainer_wait_s"),
        ],
        "rollout": [
            ("generate", "perf/generate_s"),
            ("reward", "perf/reward_s"),
            ("wait at bound", "perf/rollout_wait_s"),
        ],
    },
}


def _png(fig: Figure) -> str:
    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return f'<img src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _table(header: list[str], rows: list[list[str]], cls: str) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows
    )
    return f'<table class="{cls}"><tr>{head}</tr>{body}</table>'


def run_report_html(tracking_uri: str | None, run_id: str) -> str:
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    names = set(run.data.metrics)

    def history(key: str) -> list[tuple[int, float]]:
        if key not in names:
            return []
        by_step = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        return sorted(by_step.items())

    mode = run.data.tags.get("relax.mode", "colocate")
    sections = [_header(run, tracking_uri, history("eval/accuracy"))]
    sections.append(_curves(history))
    sections.append(_staleness(names, history))
    sections.append(_timing(mode, history))
    style = (
        "body{font-family:sans-serif}table{border-collapse:collapse;margin:6px 0}"
        "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
    )
    return f"<html><head><style>{style}</style></head><body>{''.join(sections)}</body></html>"


def _header(run, tracking_uri: str | None, evals: list[tuple[int, float]]) -> str:
    info = run.info
    link = f"{tracking_uri or ''}#/experiments/{info.experiment_id}/runs/{info.run_id}"
    if (tracking_uri or "").startswith(("http://", "https://")):
        link_html = f'<a href="{html.escape(link)}">{html.escape(link)}</a>'
    else:
        link_html = f"<code>{html.escape(link)}</code> (open with <code>mlflow ui</code>)"
    first = f"{evals[0][1]:.3f} (step {evals[0][0]})" if evals else "-"
    last = f"{evals[-1][1]:.3f} (step {evals[-1][0]})" if evals else "-"
    tags = run.data.tags
    rows = [
        ["run", tags.get("relax.run_id", info.run_name or "")],
        ["mode", tags.get("relax.mode", "")],
        ["held-out accuracy, first", first],
        ["held-out accuracy, last", last],
    ]
    return (
        '<section id="header"><h2>Run report</h2>'
        + _table(["", ""], rows, "header")
        + f"<p>MLflow run: {link_html}</p></section>"
    )


def _curves(history) -> str:
    fig = Figure(figsize=(7, 3))
    ax = fig.add_subplot(1, 1, 1)
    for key, label in (("train/reward_mean", "reward (train)"), ("train/accuracy", "accuracy")):
        points = history(key)
        if points:
            ax.plot([s for s, _ in points], [v for _, v in points], label=label, lw=1)
    evals = history("eval/accuracy")
    if evals:
        ax.plot([s for s, _ in evals], [v for _, v in evals], "o-", label="held-out accuracy")
    ax.set_xlabel("policy version (step)")
    ax.legend(loc="lower right", fontsize=8)
    return f'<section id="curves"><h3>Reward and accuracy</h3>{_png(fig)}</section>'


def _staleness(names: set[str], history) -> str:
    counts: dict[int, float] = {}
    for name in names:
        match = _HIST.match(name)
        if match:
            counts[int(match.group(1))] = sum(v for _, v in history(name))
    what = "groups trained, by staleness (versions between generation and training)"
    if not counts:  # runs from before the histogram was logged: steps by their max staleness
        for _, v in history("train/staleness_max"):
            counts[int(v)] = counts.get(int(v), 0) + 1
        what = "steps, by their largest staleness"
    counts = dict(sorted(counts.items()))
    fig = Figure(figsize=(5, 2.5))
    ax = fig.add_subplot(1, 1, 1)
    ax.bar([str(k) for k in counts], list(counts.values()), color="#4c72b0")
    ax.set_xlabel("staleness")
    rows = [[str(k), f"{n:g}"] for k, n in counts.items()]
    return (
        f'<section id="staleness"><h3>Staleness: {html.escape(what)}</h3>{_png(fig)}'
        + _table(["staleness", "count"], rows, "staleness")
        + "</section>"
    )


def _timing(mode: str, history) -> str:
    bars: dict[str, list[tuple[str, float]]] = {}
    for role, phases in _PHASES.get(mode, _PHASES["colocate"]).items():
        parts = [
            (label, statistics.median(v for _, v in h))
            for label, key in phases
            if (h := history(key))
        ]
        if parts:
            bars[role] = parts
    fig = Figure(figsize=(7, 0.8 + 0.6 * max(1, len(bars))))
    ax = fig.add_subplot(1, 1, 1)
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"]
    for y, (role, parts) in enumerate(bars.items()):
        left = 0.0
        for i, (label, value) in enumerate(parts):
            ax.barh(y, value, left=left, color=colors[i % len(colors)], label=f"{role}: {label}")
            left += value
    ax.set_yticks(range(len(bars)), list(bars))
    ax.set_xlabel("seconds per step (median)")
    if bars:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    rows = [[role, label, f"{value:.4f}"] for role, parts in bars.items() for label, value in parts]
    return (
        f'<section id="timing"><h3>Where each role spends a step</h3>{_png(fig)}'
        + _table(["role", "phase", "median s/step"], rows, "timing")
        + "</section>"
    )
