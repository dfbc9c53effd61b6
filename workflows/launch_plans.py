"""Scheduled post-training: launch plans over the `train` workflow.

`nightly_grpo` runs the CPU default's GRPO recipe every night at 02:00 UTC on whatever
`data.train_path` holds then (point it at the dataset snapshot your pipeline refreshes), starting
from the newest registered version of the policy (`models:/relax-cpu-default/latest`, pinned to a
version number when the run starts) and registering its own final policy as the next version, so
the model registry carries each night's result to the next. The first version comes from any run
with `tracking.registered_model: relax-cpu-default` (the CPU default sets it). Activate it on a
cluster with `flytectl update launchplan -p <project> -d <domain> nightly_grpo --version <v>
--activate`.
"""

from __future__ import annotations

import os

from flytekit import CronSchedule, LaunchPlan
from flytekit.models.common import RawOutputDataConfig

from relax_core.config import load_config, replace
from workflows.train import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NIGHTLY_CRON = "0 2 * * *"
NIGHTLY_MODEL = "relax-cpu-default"
RAW_DATA_PREFIX = os.environ.get("RELAX_RAW_DATA_PREFIX", "s3://my-flyte-bucket/relax/raw")
"""Where the executions of the launch plan keep Flyte's offloaded data (the bucket of
flyte.config); set RELAX_RAW_DATA_PREFIX when registering to use another."""


def nightly_config():
    """The CPU default's RL recipe, from the newest registered policy, registering the next."""
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    return replace(
        cfg,
        run_name="nightly-grpo",
        model={"kind": "pretrained", "source": f"models:/{NIGHTLY_MODEL}/latest"},
        warm_start={"steps": 0},
        tracking={"experiment": "relax-nightly", "registered_model": NIGHTLY_MODEL},
    )


nightly_grpo = LaunchPlan.get_or_create(
    workflow=train,
    name="nightly_grpo",
    default_inputs={"cfg": nightly_config()},
    schedule=CronSchedule(schedule=NIGHTLY_CRON),
    raw_output_data_config=RawOutputDataConfig(output_location_prefix=RAW_DATA_PREFIX),
)
