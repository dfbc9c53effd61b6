"""Experiment tracking: the Monitor protocol, an MLflow implementation, console progress.

`MLflowMonitor` lives in mlflow_monitor.py and is imported from there where it is used:
importing mlflow takes seconds, which a role that never logs should not pay.

May import: config, data, models, queue, rollout, storage.
"""

from __future__ import annotations

from relax_core.tracking.console import ProgressBar, format_summary
from relax_core.tracking.monitor import Monitor, NullMonitor, flatten_params

__all__ = [
    "Monitor",
    "NullMonitor",
    "ProgressBar",
    "flatten_params",
    "format_summary",
]
