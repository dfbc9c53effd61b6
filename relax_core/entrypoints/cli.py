"""`relax`: the command line for people operating runs (`relax queue`, `relax compare`,
`relax scale`, `relax send-metrics`, `relax plan`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from relax_core.entrypoints import plan as plan_cli
from relax_core.entrypoints import queue as queue_cli
from relax_core.entrypoints import scale as scale_cli
from relax_core.entrypoints import send_metrics as send_metrics_cli

ACCURACY_METRIC = "eval/accuracy"


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "refs", nargs="+", metavar="REF", help="MLflow run id or run name (at least two)"
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite ./mlflow.db)",
    )
    parser.add_argument(
        "--ui", default=None, help="MLflow UI base URL (default: MLFLOW_UI_URL, else :5000)"
    )


def run_compare(args: argparse.Namespace) -> int:
    """Print the MLflow UI URL comparing the runs; one line per run on stderr."""
    # mlflow is imported here so `relax queue` does not pay for it.
    from relax_core.tracking import compare
    from relax_core.tracking.store import default_tracking_uri

    if len(args.refs) < 2:
        print("error: relax compare needs at least two runs", file=sys.stderr)
        return 2
    tracking_uri = args.tracking_uri or default_tracking_uri()
    try:
        runs = compare.resolve_runs(tracking_uri, args.refs)
        url = compare.compare_url(
            args.ui or compare.ui_base_url(),
            [run.info.experiment_id for run in runs],
            [run.info.run_id for run in runs],
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for run in runs:
        accuracy = run.data.metrics.get(ACCURACY_METRIC)
        shown = "not logged" if accuracy is None else f"{accuracy:.4g}"
        print(f"{run.info.run_name}  {run.info.run_id}  {ACCURACY_METRIC}={shown}", file=sys.stderr)
    print(url)
    return 0


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "queue": queue_cli.run,
    "compare": run_compare,
    "scale": scale_cli.run,
    "send-metrics": send_metrics_cli.run,
    "plan": plan_cli.run,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relax")
    commands = parser.add_subparsers(dest="command", required=True)
    queue_cli.add_arguments(
        commands.add_parser("queue", help="stages, backlog, leases, staleness and quarantine")
    )
    add_compare_arguments(
        commands.add_parser("compare", help="print the MLflow UI URL comparing two or more runs")
    )
    scale_cli.add_arguments(
        commands.add_parser("scale", help="show, grow or shrink a running run's rollout engines")
    )
    send_metrics_cli.add_arguments(
        commands.add_parser("send-metrics", help="send metrics kept while MLflow was down")
    )
    plan_cli.add_arguments(
        commands.add_parser("plan", help="placement and per-GPU memory of a config, by part")
    )
    args = parser.parse_args(argv)
    return _COMMANDS[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
