"""A trainer over several devices: `train.backend: fsdp` with services.trainer_gpus 2 runs the
async trainer under torchrun, rank 0 leading and rank 1 following (train/ranks.py), FSDP2 over
gloo on CPU (NCCL on GPUs is the same code), while the weight sync to the rollout engine keeps a
group of its own. One LoRA run (the module's `run` fixture) is read several ways: it trains every
group once and stops both ranks, the supervisor watches rank 0's beat, mid-run evals score a copy
filled with the adapter gathered from both ranks, the KL anchor is the starting policy, and each
checkpoint is the frozen base + the trained adapter + the optimizer state. A full-weight run of
the same size (`full_run`) syncs every weight rank 0 gathers from the two shards. (That two FSDP
ranks compute what one process does and resume it exactly is tests/integration/test_fsdp.py's.)"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from relax_core.models.lora import ADAPTER_DIR
from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.storage import read_json
from relax_core.train.checkpoint import list_checkpoints, read_state
from tests.conftest import SMALL_RUN, workdir_for
from tests.integration.test_async_run import _final, _metrics
from tests.runs import run_small

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 4
GROUPS_PER_STEP = SMALL_RUN["rollout"]["groups_per_step"]
RUN = {
    "run_name": "fsdp",
    "mode": "async",
    "rollout": {"max_staleness": 1},
    # Mid-run evals gather the sharded adapter from both ranks into a copy to generate with.
    "train": {
        "total_steps": STEPS,
        "checkpoint_every": 2,
        "eval_every": 2,
        "backend": "fsdp",
        "lr": 5e-3,
        "lora": {"rank": 4},
    },
    # The entropy bonus gives every step a gradient; the KL term brings in the reference role,
    # whose anchor is the starting policy (the base: every adapter's B starts at zero).
    "algorithm": {"entropy_coef": 0.01, "kl_coef": 0.01},
    # 20 s of silence, not 5: beside the suite's other worker on an AVX2-only 2-core machine a
    # healthy rank 0's beat once waited 5 s (the run recovered, 3 restarts; alone: none).
    # 60 s to start, not 30: beside the pod rehearsal's servers and pods two ranks' imports took
    # longer, and the restarts each left two ranks running (relax_core/roles/torchrun.py).
    "services": {
        "trainer_threads": 1,
        "poll_s": 0.002,
        "heartbeat_s": 0.2,
        "heartbeat_timeout_s": 20.0,
        "start_timeout_s": 60.0,
        "trainer_gpus": 2,
    },
}


@dataclasses.dataclass
class TwoRankRun:
    """What the run left: where it ran, its stderr, its final checkpoint and state."""

    workdir: Path
    stderr: str
    final: str
    state: dict


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoRankRun]:
    for workdir in workdir_for(tmp_path_factory, "two-ranks"):
        # 40-100 s under a load of 5 to 20; a run that hangs fails with every rank's stacks.
        stderr = run_small(workdir, "fsdp.yaml", **RUN)
        final = _final(workdir, "fsdp")
        yield TwoRankRun(workdir, stderr, final, read_state(final))


def test_two_ranks_train_every_group_once_and_both_stop(run: TwoRankRun):
    recovery = read_json(os.path.join(os.path.dirname(run.final), "recovery.json"))
    no_restarts = recovery["role_restarts"] == {} and recovery["global_restarts"] == 0
    assert no_restarts, f"{recovery}\n{run.stderr[-6000:]}"
    assert run.state["policy_version"] == STEPS
    queue = TransferQueue(str(run.workdir / ".relax" / "queue"), run.state["run_id"])
    audit = audit_run(queue, run.state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == STEPS * GROUPS_PER_STEP, audit
    # Both ranks ran: the second rank's line in the trainer's log says how many steps it took.
    assert "rank 1: stop after" in run.stderr


def test_the_supervisor_watches_the_beat_of_torchruns_rank_0(run: TwoRankRun):
    """The supervisor starts torchrun, not the rank that beats: the liveness file it watches
    for the trainer (roles.json) must be one rank 0 touched while the run went on, or a healthy
    trainer is killed as silent once services.start_timeout_s has passed."""
    run_dir = os.path.dirname(run.final)
    roles = read_json(os.path.join(run_dir, "roles.json"))
    (trainer,) = [r for r in roles if r["role"] == "trainer"]
    assert trainer["group"] and trainer["exit_code"] == 0, trainer
    assert os.path.isfile(trainer["liveness"]), trainer
    first = min(list_checkpoints(run_dir))  # written before any role starts
    assert os.path.getmtime(trainer["liveness"]) > os.path.getmtime(first)


def test_checkpoints_hold_the_frozen_base_the_trained_adapter_and_the_optimizer(
    run: TwoRankRun,
):
    # FSDP's checkpoint: the HF policy (what engines load) and its optimizer state.
    assert os.path.isfile(os.path.join(run.final, "optim", "optimizer.pt"))
    start = min(list_checkpoints(os.path.dirname(run.final)))
    start_base = load_file(os.path.join(start, "model.safetensors"))
    base = load_file(os.path.join(run.final, "model.safetensors"))
    assert base.keys() == start_base.keys()
    for name, tensor in base.items():
        assert torch.equal(tensor, start_base[name]), name  # the base never trains
    adapter = load_file(os.path.join(run.final, ADAPTER_DIR, "adapter_model.safetensors"))
    assert any(t.abs().sum() > 0 for n, t in adapter.items() if "lora_B" in n)  # it learned


def test_evals_and_the_kl_anchor_see_the_adapter_both_ranks_trained(run: TwoRankRun):
    run_id = run.state["tracking_run_id"]
    assert len(_metrics(run.workdir, run_id, "eval/accuracy")) >= 2
    # The reference scores the starting policy, which the policy equals until the adapter
    # first trains (B starts at zero), and parts from after.
    kl = _metrics(run.workdir, run_id, "train/kl")
    assert len(kl) == STEPS and abs(kl[0]) < 1e-7 and kl[-1] > 1e-6, kl


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoRankRun]:
    """The same run with full weights: rank 0 gathers every sharded weight for the sync."""
    train = {k: v for k, v in RUN["train"].items() if k != "lora"}
    for workdir in workdir_for(tmp_path_factory, "two-ranks-full"):
        stderr = run_small(workdir, "full.yaml", **{**RUN, "train": train, "run_name": "full"})
        final = _final(workdir, "full")
        yield TwoRankRun(workdir, stderr, final, read_state(final))


def test_a_full_weight_two_rank_trainer_syncs_what_it_trains_to_the_engine(full_run: TwoRankRun):
    """Both ranks train every group once; the engine samples with each version the trainer
    gathers from its two shards (rows stamped with versions past the start, within the
    staleness bound); the checkpoint holds the trained weights and the optimizer state."""
    run = full_run
    assert run.state["policy_version"] == STEPS
    assert "rank 1: stop after" in run.stderr
    queue = TransferQueue(str(run.workdir / ".relax" / "queue"), run.state["run_id"])
    audit = audit_run(queue, run.state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    assert audit["trained_groups"] == STEPS * GROUPS_PER_STEP, audit
    versions = set()
    for seq in queue.committed("rollout"):
        versions.update(queue.read("rollout", seq).column("behaviour_version_max").to_pylist())
    assert max(versions) >= STEPS - 1, sorted(versions)  # the engine took the gathered weights
    staleness = _metrics(run.workdir, run.state["tracking_run_id"], "train/staleness_max")
    assert len(staleness) == STEPS and max(staleness) <= 1, staleness
    assert os.path.isfile(os.path.join(run.final, "optim", "optimizer.pt"))
    start = min(list_checkpoints(os.path.dirname(run.final)))
    before = load_file(os.path.join(start, "model.safetensors"))
    after = load_file(os.path.join(run.final, "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(after[k], t) for k, t in before.items()), "nothing trained"
    assert len(_metrics(run.workdir, run.state["tracking_run_id"], "eval/accuracy")) >= 2
