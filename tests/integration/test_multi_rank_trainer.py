"""A trainer over several devices: `train.backend: fsdp` with services.trainer_gpus 2 runs the
async trainer under torchrun, rank 0 leading and rank 1 following (train/ranks.py), FSDP2 over
gloo on CPU (NCCL on GPUs is the same code), while the weight sync to the rollout engine keeps a
group of its own. The run must train every group once and stop both ranks. (That two FSDP ranks
compute what one process does is tests/integration/test_fsdp.py's.)"""

from __future__ import annotations

import os

import pytest

from relax_core.queue import TransferQueue
from relax_core.queue.audit import audit_run
from relax_core.storage import read_json
from relax_core.train.checkpoint import find_resume_checkpoint, read_state
from tests.runs import run_to_end

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_an_async_run_trains_with_a_two_rank_fsdp_trainer(small_config, workdir):
    total = 400
    cfg = small_config(
        "fsdp.yaml",
        run_name="fsdp",
        mode="async",
        rollout={"max_staleness": 1},
        # Mid-run evals gather the sharded weights from both ranks into a copy to generate with.
        train={"total_steps": total, "checkpoint_every": 200, "eval_every": 200, "backend": "fsdp"},
        # The run (85-135 s) outlasts start_timeout_s: the supervisor must see torchrun's rank 0
        # beating for the torchrun process it started, or it kills a healthy trainer as silent.
        # 20 s of silence, not 5: beside the suite's other worker on an AVX2-only 2-core machine
        # a healthy rank 0's beat once waited 5 s (the run recovered, 3 restarts; alone: none).
        # 60 s to start, not 30: beside the pod rehearsal's servers and pods two ranks' imports
        # took longer, and the restarts each left two ranks running (relax_core/roles/torchrun.py).
        services={
            "trainer_threads": 1,
            "poll_s": 0.002,
            "heartbeat_s": 0.2,
            "heartbeat_timeout_s": 20.0,
            "start_timeout_s": 60.0,
            "trainer_gpus": 2,
        },
    )
    # ~100 s beside the suite's other worker; a run that hangs fails with every rank's stacks.
    out = run_to_end(cfg, timeout_s=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    final = find_resume_checkpoint(".relax/checkpoints", "fsdp")
    state = read_state(final)
    recovery = read_json(os.path.join(os.path.dirname(final), "recovery.json"))
    no_restarts = recovery["role_restarts"] == {} and recovery["global_restarts"] == 0
    assert no_restarts, f"{recovery}\n{out.stderr[-6000:]}"
    assert state["policy_version"] == total
    audit = audit_run(TransferQueue(".relax/queue", state["run_id"]), state)
    assert audit["lost_groups"] == 0 and audit["duplicated_groups"] == 0, audit
    # Both ranks ran: the second rank's line in the trainer's log says how many steps it took.
    assert "rank 1: stop after" in out.stderr
    # FSDP's checkpoint: the HF policy (what engines load) and its optimizer state.
    assert os.path.isfile(os.path.join(final, "model.safetensors"))
    assert os.path.isfile(os.path.join(final, "optim", "optimizer.pt"))
