"""Scheduled post-training: launch plans over the `train` workflow.

`nightly_grpo` runs the CPU default's GRPO recipe every night at 02:00 UTC on whatever
`data.train_path` holds then (point it at the dataset snapshot your pipeline refreshes), starting
from the newest registered version of the policy (`models:/relax-cpu-default/latest`, pinned to a
version number when the run starts) and registering its own final policy as the next version, so
the model registry carries each night's result to the next. The first version comes from any run
with `tracking.registered_model: relax-cpu-default` (the CPU default sets it). Activate it on a
cluster with `flytectl update launchplan -p <project> -d <domain> nightly_grpo --version <v>
--activate`.

Its config is baked in at registration: the registration config ($RELAX_CONFIG, the cluster
config you register with) with the nightly recipe on top, so its storage root, tracking server,
`cluster` timings and accelerator are the cluster's. Without $RELAX_CONFIG it is the CPU default
as is (local storage, a SQLite tracking store): fine for `pyflyte run` here, refused by the first
task in a pod, naming storage.root (`relax plan --flyte` says so before registration).
"""

from __future__ import annotations

import os

from flytekit import CronSchedule, LaunchPlan
from flytekit.models.common import RawOutputDataConfig

from workflows.nightly import NIGHTLY_CRON, nightly_config  # noqa: F401 - NIGHTLY_CRON re-exported
from workflows.train import train

RAW_DATA_PREFIX = os.environ.get("RELAX_RAW_DATA_PREFIX", "s3://my-flyte-bucket/relax/raw")
"""Where the executions of the launch plan keep Flyte's offloaded data (the bucket of
flyte.config); set RELAX_RAW_DATA_PREFIX when registering to use another."""

nightly_grpo = LaunchPlan.get_or_create(
    workflow=train,
    name="nightly_grpo",
    default_inputs={"cfg": nightly_config()},
    schedule=CronSchedule(schedule=NIGHTLY_CRON),
    raw_output_data_config=RawOutputDataConfig(output_location_prefix=RAW_DATA_PREFIX),
)
