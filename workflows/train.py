"""`train`: one RL run as a Flyte workflow.

    pyflyte run workflows/train.py train --cfg configs/cpu-default.yaml   # colocate
    pyflyte run workflows/train.py train --cfg configs/cpu-async.yaml     # async, local processes

prepare_data (validate, fingerprint, how the steps run) -> policy_spec -> prepare_policy (cached
warm start) -> start_run (eval at step 0, checkpoint v0) -> the steps -> finish_run (final eval,
summary). How the steps run is a branch of the graph, chosen by the config:
- colocate: rl_loop, a recursive @dynamic of rl_steps nodes (`steps_per_node` steps each, every
  role inside the node, max_staleness 0);
- async-processes (`mode: async`, `services.launch: processes`): one async_local node that starts
  every role as an OS process and supervises it (local execution, or one big pod);
- async-tasks (`services.launch: tasks`): async_roles, one task per role started side by side
  (each with the resources the run's own config asks, tasks/resources.py), connected by the
  queue and the weight-sync group; the trainer task's output (the final checkpoint) is what
  finish_run waits for.
"""

from __future__ import annotations

from flytekit import conditional, dynamic, workflow

from relax_core.config import RunConfig
from relax_core.train.checkpoint import read_state
from tasks.resources import node_overrides
from tasks.rl import (
    RunSummary,
    actor_fwd_service,
    advantages_service,
    async_local,
    finish_run,
    policy_spec,
    prepare_data,
    prepare_policy,
    reference_service,
    rl_steps,
    rollout_service,
    sglang_rollout_service,
    start_run,
    trainer_service,
)


def loop_done(cfg_json: str, checkpoint: str) -> bool:
    """Whether the run of `checkpoint` has trained every step (read from the run's storage)."""
    cfg = RunConfig.from_json(cfg_json)
    state = read_state(checkpoint, cfg.storage.options())
    return state["policy_version"] >= cfg.train.total_steps


@dynamic
def rl_loop(cfg_json: str, checkpoint: str) -> str:
    """Recursion instead of a loop: a @dynamic builds its whole graph before running."""
    if loop_done(cfg_json, checkpoint):
        return checkpoint
    steps = rl_steps(cfg_json=cfg_json, checkpoint=checkpoint).with_overrides(
        **node_overrides(RunConfig.from_json(cfg_json), rl_steps)
    )
    return rl_loop(cfg_json=cfg_json, checkpoint=steps)


@dynamic
def async_roles(cfg_json: str, checkpoint: str) -> str:
    """Every role of an async run as its own task, with no edges between them, so a cluster runs
    them in parallel. (Local execution would run them one after another and never finish: use
    `services.launch: processes` there.)"""
    from relax_core.roles.service import stage_chain

    cfg = RunConfig.from_json(cfg_json)
    rollout = sglang_rollout_service if cfg.rollout.engine == "sglang" else rollout_service
    for worker in range(cfg.services.rollout_workers):
        node = rollout(cfg_json=cfg_json, checkpoint=checkpoint, worker=worker)
        node.with_overrides(**node_overrides(cfg, rollout))
    services = {
        "reference": reference_service,
        "actor_fwd": actor_fwd_service,
        "advantages": advantages_service,
    }
    for role, _, _ in stage_chain(cfg):
        node = services[role](cfg_json=cfg_json, checkpoint=checkpoint)
        node.with_overrides(**node_overrides(cfg, services[role]))
    return trainer_service(cfg_json=cfg_json, checkpoint=checkpoint).with_overrides(
        **node_overrides(cfg, trainer_service)
    )


@workflow
def train(cfg: RunConfig) -> RunSummary:
    prepared = prepare_data(cfg=cfg)
    cfg_json = prepared.cfg_json
    spec = policy_spec(cfg_json=cfg_json, data_fingerprint=prepared.data_fingerprint)
    policy_dir = prepare_policy(
        spec_json=spec, cache_dir=prepared.policy_cache, storage_json=prepared.storage_json
    )
    start = start_run(cfg_json=cfg_json, policy_dir=policy_dir)
    final = (
        conditional("execution")
        .if_(prepared.execution == "colocate")
        .then(rl_loop(cfg_json=cfg_json, checkpoint=start))
        .elif_(prepared.execution == "async-processes")
        .then(async_local(cfg_json=cfg_json, checkpoint=start))
        .else_()
        .then(async_roles(cfg_json=cfg_json, checkpoint=start))
    )
    return finish_run(cfg_json=cfg_json, checkpoint=final)
