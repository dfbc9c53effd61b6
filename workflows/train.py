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
def rl_loop(cfg: RunConfig, checkpoint: str) -> str:
    """Recursion instead of a loop: a @dynamic builds its whole graph before running."""
    if read_state(checkpoint)["policy_version"] >= cfg.train.total_steps:
        return checkpoint
    return rl_loop(cfg=cfg, checkpoint=rl_steps(cfg=cfg, checkpoint=checkpoint))


@workflow
def train(cfg: RunConfig) -> RunSummary:
    fingerprint = prepare_data(cfg=cfg)
    spec = policy_spec(cfg=cfg, data_fingerprint=fingerprint)
    policy_dir = prepare_policy(spec=spec, cache_dir=cfg.checkpoint.policy_cache_dir)
    start = start_run(cfg=cfg, policy_dir=policy_dir)
    return finish_run(cfg=cfg, checkpoint=rl_loop(cfg=cfg, checkpoint=start))
