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

from relax_core.config import RunConfig, load_config, replace
from tasks.resources import CONFIG_ENV, registration_config
from workflows.train import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NIGHTLY_CRON = "0 2 * * *"
NIGHTLY_MODEL = "relax-cpu-default"
RAW_DATA_PREFIX = os.environ.get("RELAX_RAW_DATA_PREFIX", "s3://my-flyte-bucket/relax/raw")
"""Where the executions of the launch plan keep Flyte's offloaded data (the bucket of
flyte.config); set RELAX_RAW_DATA_PREFIX when registering to use another."""


def nightly_base() -> RunConfig:
    """The registration config when $RELAX_CONFIG names one, else the CPU default."""
    if os.environ.get(CONFIG_ENV):
        return registration_config()
    return load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))


def nightly_config() -> RunConfig:
    """The base's RL recipe, from the newest registered policy, registering the next, with the
    base's storage, tracking server and cluster settings."""
    return replace(
        nightly_base(),
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
