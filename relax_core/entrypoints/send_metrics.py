"""`relax send-metrics`: send the metrics runs left unsent while their MLflow tracking server was
down, and set the status runs ended with then (tracking/spool.py).

    relax send-metrics [ROOT] [--tracking-uri URI] [--endpoint-url URL]

ROOT is the runs' storage.root (default .relax; an s3:// URL on a cluster) or its mlflow-spool
directory. A run that starts on that storage while the server answers does the same by itself.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "root", nargs="?", default=".relax", help="storage.root, or its mlflow-spool directory"
    )
    parser.add_argument(
        "--tracking-uri",
        default=None,
        help="MLflow tracking URI the metrics were for (default: MLFLOW_TRACKING_URI, else "
        "sqlite ./mlflow.db); files for other URIs are left alone",
    )
    parser.add_argument(
        "--endpoint-url", default="", help="S3 endpoint of an s3:// root (storage.endpoint_url)"
    )


def run(args: argparse.Namespace) -> int:
    # mlflow is imported here so other `relax` commands do not pay for it.
    from mlflow.tracking import MlflowClient

    from relax_core.tracking.outage import brief, is_outage
    from relax_core.tracking.spool import SPOOL_DIR, MetricSpool, spool_dir_of
    from relax_core.tracking.store import default_tracking_uri

    root = args.root.rstrip("/")
    directory = root if root.endswith(SPOOL_DIR) else spool_dir_of(root)
    options = {"client_kwargs": {"endpoint_url": args.endpoint_url}} if args.endpoint_url else {}
    uri = args.tracking_uri or default_tracking_uri()
    spool = MetricSpool(directory, options)
    try:
        sent = spool.send_others(MlflowClient(uri), uri)
    except Exception as err:
        if not is_outage(err):
            raise
        print(
            f"error: MLflow at {uri} is unreachable ({brief(err)}); nothing sent", file=sys.stderr
        )
        return 1
    print(f"sent {sent} metrics from {directory} to {uri}", file=sys.stderr)
    left = spool.files()
    for location in left:
        print(f"left: {location}", file=sys.stderr)
    return 1 if left else 0
