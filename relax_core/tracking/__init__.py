"""Experiment tracking: the Monitor protocol, an MLflow implementation, console progress.

`MLflowMonitor` is loaded on first use, because importing mlflow takes seconds and a run with
tracking off (NullMonitor) should not pay for it.

May import: config, data, models, rollout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_core.tracking.console import ProgressBar, format_summary
from relax_core.tracking.monitor import Monitor, NullMonitor, flatten_params

if TYPE_CHECKING:
    from relax_core.tracking.mlflow_monitor import MLflowMonitor

__all__ = [
    "MLflowMonitor",
    "Monitor",
    "NullMonitor",
    "ProgressBar",
    "flatten_params",
    "format_summary",
]


def __getattr__(name: str) -> object:
    if name == "MLflowMonitor":
        from relax_core.tracking.mlflow_monitor import MLflowMonitor

        return MLflowMonitor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
