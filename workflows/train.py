"""`train`: one RL run as a Flyte workflow.

    pyflyte run workflows/train.py train --cfg configs/cpu-default.yaml

prepare_data (validate, fingerprint) -> policy_spec -> prepare_policy (cached warm start) ->
start_run (eval at step 0, checkpoint v0) -> rl_loop (recursive @dynamic, `steps_per_node` steps
per node, checkpoint between nodes) -> finish_run (final eval, summary).
Colocate mode: every role of a step runs inside the rl_steps node (max_staleness 0).
"""

from __future__ import annotations

from flytekit import dynamic, workflow

from relax_core.config import RunConfig
from relax_core.train.checkpoint import read_state
from tasks.rl import (
    RunSummary,
    finish_run,
    policy_spec,
    prepare_data,
    prepare_policy,
    rl_steps,
    start_run,
)


@dynamic
def rl_loop(cfg_json: str, checkpoint: str) -> str:
    """Recursion instead of a loop: a @dynamic builds its whole graph before running."""
    if read_state(checkpoint)["policy_version"] >= RunConfig.from_json(cfg_json).train.total_steps:
        return checkpoint
    return rl_loop(cfg_json=cfg_json, checkpoint=rl_steps(cfg_json=cfg_json, checkpoint=checkpoint))


@workflow
def train(cfg: RunConfig) -> RunSummary:
    prepared = prepare_data(cfg=cfg)
    cfg_json = prepared.cfg_json
    spec = policy_spec(cfg_json=cfg_json, data_fingerprint=prepared.data_fingerprint)
    policy_dir = prepare_policy(spec_json=spec, cache_dir=cfg.checkpoint.policy_cache_dir)
    start = start_run(cfg_json=cfg_json, policy_dir=policy_dir)
    return finish_run(cfg_json=cfg_json, checkpoint=rl_loop(cfg_json=cfg_json, checkpoint=start))
