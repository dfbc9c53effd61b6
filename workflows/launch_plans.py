"""Scheduled post-training: launch plans over the `train` workflow.

`nightly_grpo` runs the CPU default's GRPO recipe every night at 02:00 UTC on whatever
`data.train_path` holds then (point it at the dataset snapshot your pipeline refreshes), resuming
the newest run of the same `run_name` from its last checkpoint (`checkpoint.resume: true`), so
each night continues where the previous one stopped. Activate it on a cluster with
`flytectl update launchplan -p <project> -d <domain> nightly_grpo --version <v> --activate`.
"""

from __future__ import annotations

import os

from flytekit import CronSchedule, LaunchPlan

from relax_core.config import load_config, replace
from workflows.train import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NIGHTLY_CRON = "0 2 * * *"


def nightly_config():
    """The CPU default recipe, resuming the newest run of its name each night."""
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    return replace(cfg, checkpoint={"resume": True}, tracking={"experiment": "relax-nightly"})


nightly_grpo = LaunchPlan.get_or_create(
    workflow=train,
    name="nightly_grpo",
    default_inputs={"cfg": nightly_config()},
    schedule=CronSchedule(schedule=NIGHTLY_CRON),
)
