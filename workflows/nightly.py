"""The nightly recipe (what `nightly_grpo` of workflows/launch_plans.py and the Flyte 2 nightly
trigger of flyte2/train.py run): the registration config with the nightly GRPO settings on top.
Kept apart from the launch plan so the Flyte 2 entry point takes it without flytekit's workflow.
"""

from __future__ import annotations

import os

from relax_core.config import RunConfig, load_config, replace
from tasks.resources import CONFIG_ENV, registration_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NIGHTLY_CRON = "0 2 * * *"
NIGHTLY_MODEL = "relax-cpu-default"


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
