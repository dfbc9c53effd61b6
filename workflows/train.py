"""`train`: one RL run as a Flyte workflow.

    pyflyte run workflows/train.py train --cfg configs/cpu-default.yaml   # colocate
    pyflyte run workflows/train.py train --cfg configs/cpu-async.yaml     # async, local processes

prepare_data (validate, fingerprint, how the steps run) -> policy_spec -> prepare_policy (cached
warm start) -> start_run (eval at step 0, checkpoint v0) -> rl_run (the steps) -> finish_run
(final eval, summary). rl_run is a @dynamic that builds the steps from the run's own config,
each node with that config's resources and timeouts (tasks/resources.py: node_overrides):
- colocate: rl_steps nodes of `steps_per_node` steps each, every role inside the node
  (max_staleness 0), in rl_segment @dynamic nodes: N nodes go in about sqrt(N) segments of about
  sqrt(N) nodes (relax_core/ops/asks.py: loop_shape). The graph is three levels deep whatever
  the run's length: flytekit's local sandbox paths and a cluster's storage keys grow with each
  nested level, and a recursion one level per node hit the file-name limit at the 30th node
  locally and S3's 1,024-byte keys near 150 on a cluster; sqrt keeps every @dynamic small (80
  nodes: 9 segments of at most 9).
- async-processes (`mode: async`, `services.launch: processes`): one async_local node that starts
  every role as an OS process and supervises it (local execution, or one big pod);
- async-tasks (`services.launch: tasks`): one task per role, started side by side (no edges
  between them), connected by the queue and the weight-sync group; the trainer task's output
  (the final checkpoint) is what finish_run waits for. (Local execution would run them one after
  another and never finish: use `services.launch: processes` there.)
"""

from __future__ import annotations

from flytekit import dynamic, workflow

from relax_core.config import RunConfig
from relax_core.ops.asks import loop_shape, remaining_steps, role_tasks, segment_timeout_s
from tasks.bodies import trained
from tasks.resources import node_overrides, registered
from tasks.rl import (
    RunSummary,
    actor_fwd_service,
    advantages_service,
    async_local,
    execution_of,
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

ROLE_TASKS = {
    "rollout_service": rollout_service,
    "sglang_rollout_service": sglang_rollout_service,
    "reference_service": reference_service,
    "actor_fwd_service": actor_fwd_service,
    "advantages_service": advantages_service,
    "trainer_service": trainer_service,
}


@dynamic(**registered("rl_segment"))
def rl_segment(cfg_json: str, checkpoint: str, nodes: int) -> str:
    """`nodes` rl_steps nodes, one after another."""
    cfg = RunConfig.from_json(cfg_json)
    overrides = node_overrides(cfg, rl_steps)
    for _ in range(nodes):
        checkpoint = rl_steps(cfg_json=cfg_json, checkpoint=checkpoint).with_overrides(**overrides)
    return checkpoint


@dynamic(**registered("rl_run"))
def rl_run(cfg_json: str, checkpoint: str) -> str:
    """The steps of the run from `checkpoint` (a new run's version 0, or the one resumed)."""
    cfg = RunConfig.from_json(cfg_json)
    left = remaining_steps(cfg, trained(cfg, checkpoint))
    execution = execution_of(cfg)
    if execution == "colocate":
        for nodes in loop_shape(cfg, left):
            timeout = segment_timeout_s(cfg, nodes)
            checkpoint = rl_segment(
                cfg_json=cfg_json, checkpoint=checkpoint, nodes=nodes
            ).with_overrides(**node_overrides(cfg, rl_segment, left, timeout))
        return checkpoint
    if execution == "async-processes":
        node = async_local(cfg_json=cfg_json, checkpoint=checkpoint)
        return node.with_overrides(**node_overrides(cfg, async_local, left))
    *services, trainer = role_tasks(cfg)
    workers: dict[str, int] = {}
    for name in services:
        kwargs = {"cfg_json": cfg_json, "checkpoint": checkpoint}
        if name.endswith("rollout_service"):
            kwargs["worker"] = workers[name] = workers.get(name, -1) + 1
        task = ROLE_TASKS[name]
        task(**kwargs).with_overrides(**node_overrides(cfg, task, left))
    node = ROLE_TASKS[trainer](cfg_json=cfg_json, checkpoint=checkpoint)
    return node.with_overrides(**node_overrides(cfg, ROLE_TASKS[trainer], left))


@workflow
def train(cfg: RunConfig) -> RunSummary:
    prepared = prepare_data(cfg=cfg)
    cfg_json = prepared.cfg_json
    spec = policy_spec(cfg_json=cfg_json, data_fingerprint=prepared.data_fingerprint)
    policy_dir = prepare_policy(
        spec_json=spec, cache_dir=prepared.policy_cache, storage_json=prepared.storage_json
    )
    start = start_run(cfg_json=cfg_json, policy_dir=policy_dir)
    final = rl_run(cfg_json=cfg_json, checkpoint=start)
    return finish_run(cfg_json=cfg_json, checkpoint=final)
