"""Async mode end to end: every role a real OS process, the queue on disk, weights over gloo (or
the object store), the trainer's MLflow run.

- at max_staleness 0 async is strict on-policy: it trains exactly the weights colocate trains;
- a trainer that is delayed (SIGSTOP, nothing killed) holds rollout at the staleness bound;
- all five roles run together, with partial rollouts and object-store weight sync;
- a silent or repeatedly failing role spends the restart budget (in place, then the whole run)
  and the run gives up with a report; a terminated launcher stops every role.

Killed roles restarting in place over a pruned queue, audited: test_async_retention.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import mlflow
import pytest
import torch
from safetensors.torch import load_file

from relax_core.models.precision import cpu_has_native_bf16
from relax_core.queue import AdmissionLedger, TransferQueue
from relax_core.train.checkpoint import find_resume_checkpoint, read_state

pytestmark = pytest.mark.integration


# With native bf16 dot products (AVX512-BF16, AMX) the CPU's matmul kernels accumulate in an order
# that follows the batch's shape, so an engine's decode step and the trainer's forward of the same
# rows agree to bf16 rounding, not bit for bit (on an AMD EPYC with AVX512-BF16, 2026-12-06: a
# colocate mismatch/kl of 2.7e-6 and float32 masters 2.5e-6 apart after 4 steps); where bf16 is
# emulated they agree exactly. A role computing in float32 instead is off by far more.
NATIVE_BF16 = cpu_has_native_bf16()
BF16_ATOL = 1e-5 if NATIVE_BF16 else 1e-6
BF16_KL = 1e-5 if NATIVE_BF16 else 1e-7
BF16_LOGPROB = 1e-3 if NATIVE_BF16 else 1e-6  # per token (2e-4 seen there)
ASYNC = {"mode": "async", "services": {"trainer_threads": 1, "poll_s": 0.002, "heartbeat_s": 0.2}}


def _run(cfg_path: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg_path],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def _final(workdir, name: str) -> str:
    found = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), name)
    assert found is not None
    return found


def _roles(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "roles.json")) as f:
        return json.load(f)


def _metrics(workdir, run_id: str, key: str) -> list[float]:
    mlflow.set_tracking_uri(f"sqlite:///{workdir}/mlflow.db")
    client = mlflow.tracking.MlflowClient()
    history = client.get_metric_history(run_id, key)
    return [m.value for m in sorted(history, key=lambda m: m.step)]


@pytest.mark.slow
def test_async_at_staleness_zero_trains_exactly_what_colocate_trains(small_config, workdir):
    train = {"total_steps": 6, "checkpoint_every": 3}
    colocate = small_config("c.yaml", run_name="c", train=train)
    _finish(_run(colocate))
    on_policy = small_config("a.yaml", run_name="a", train=train, **ASYNC)
    _finish(_run(on_policy))

    c_ckpt, a_ckpt = _final(workdir, "c"), _final(workdir, "a")
    assert read_state(a_ckpt)["policy_version"] == 6
    c_weights = load_file(os.path.join(c_ckpt, "model.safetensors"))
    a_weights = load_file(os.path.join(a_ckpt, "model.safetensors"))
    assert c_weights.keys() == a_weights.keys()
    for name in c_weights:
        torch.testing.assert_close(a_weights[name], c_weights[name], rtol=0, atol=1e-6)

    run_dir = os.path.dirname(a_ckpt)
    roles = _roles(run_dir)
    assert sorted(r["role"] for r in roles) == ["advantages", "rollout", "trainer"]
    assert all(r["exit_code"] == 0 and r["cpu_s"] > 0 for r in roles), roles
    state = read_state(a_ckpt)
    queue = TransferQueue(".relax/queue", state["run_id"])
    assert queue.stopped()
    assert {b["role"] for b in queue.heartbeats()} == {"trainer", "rollout", "advantages"}
    assert state["ready_cursor"]["through"] == 5  # one ready entry per step, each trained once
    assert _metrics(workdir, state["tracking_run_id"], "train/staleness_max") == [0.0] * 6


@pytest.mark.slow
def test_a_bf16_policy_trains_on_float32_master_weights_in_both_modes(small_config, workdir):
    from relax_core.train.backend import MASTER_WEIGHTS_FILE

    train = {"total_steps": 4, "checkpoint_every": 2, "lr": 1e-5}
    # The entropy bonus gives every step a gradient, whatever rewards this tiny policy earns.
    bf16 = {"model": {"dtype": "bfloat16"}, "algorithm": {"entropy_coef": 0.01}}
    _finish(_run(small_config("c.yaml", run_name="c", train=train, **bf16)))
    _finish(_run(small_config("a.yaml", run_name="a", train=train, **bf16, **ASYNC)))

    c_ckpt, a_ckpt = _final(workdir, "c"), _final(workdir, "a")
    assert read_state(a_ckpt)["policy_version"] == 4
    for ckpt in (c_ckpt, a_ckpt):
        policy = load_file(os.path.join(ckpt, "model.safetensors"))
        master = load_file(os.path.join(ckpt, MASTER_WEIGHTS_FILE))
        assert {t.dtype for t in policy.values()} == {torch.bfloat16}
        assert {t.dtype for t in master.values()} == {torch.float32}
        # Updates at this learning rate mostly hide below a bf16 rounding: the float32 master
        # holds them, and the policy engines receive is the master rounded.
        assert any(not torch.equal(m, m.to(torch.bfloat16).float()) for m in master.values())
        for name, weight in master.items():
            assert torch.equal(policy[name], weight.to(torch.bfloat16)), name
    # Strict on-policy async (gloo weight sync in bf16) trains what colocate trains.
    c_master = load_file(os.path.join(c_ckpt, MASTER_WEIGHTS_FILE))
    a_master = load_file(os.path.join(a_ckpt, MASTER_WEIGHTS_FILE))
    for name, weight in c_master.items():
        torch.testing.assert_close(a_master[name], weight, rtol=0, atol=BF16_ATOL)


@pytest.mark.slow
def test_bf16_matmuls_in_async_roles_compute_as_the_trainer(small_config, workdir):
    """`model.matmul_dtype` in async mode: the rollout role's engine, the actor_fwd and the
    reference roles compute as the trainer does under autocast. At staleness 0 the log-probs
    the engine samples with are the ones the trainer computes (no mismatch, as in colocate),
    actor_fwd's (the same weights) and the reference's on the first step (the starting
    policy) are the engine's, and the run trains what colocate trains."""
    train = {"total_steps": 4, "checkpoint_every": 2}
    bf16 = {"model": {"matmul_dtype": "bfloat16"}}
    algorithm = {"entropy_coef": 0.01, "kl_coef": 0.05}
    _finish(_run(small_config("c.yaml", run_name="c", train=train, algorithm=algorithm, **bf16)))
    roles = {**ASYNC, "services": {**ASYNC["services"], "actor_fwd": True}}
    a = small_config("a.yaml", run_name="a", train=train, algorithm=algorithm, **bf16, **roles)
    _finish(_run(a))

    c_ckpt, a_ckpt = _final(workdir, "c"), _final(workdir, "a")
    assert read_state(a_ckpt)["policy_version"] == 4
    for ckpt in (c_ckpt, a_ckpt):
        gaps = _metrics(workdir, read_state(ckpt)["tracking_run_id"], "mismatch/kl")
        assert len(gaps) == 4 and max(abs(g) for g in gaps) < BF16_KL, (ckpt, gaps)
    queue = TransferQueue(".relax/queue", read_state(a_ckpt)["run_id"])
    ready = [queue.read("ready", seq) for seq in queue.committed("ready")]
    for step, table in enumerate(ready):
        rollout = _flat(table, "rollout_logprobs")
        assert _flat(table, "old_logprobs").sub(rollout).abs().max() < BF16_LOGPROB
        if step == 0:
            assert _flat(table, "ref_logprobs").sub(rollout).abs().max() < BF16_LOGPROB
    c_weights = load_file(os.path.join(c_ckpt, "model.safetensors"))
    a_weights = load_file(os.path.join(a_ckpt, "model.safetensors"))
    assert {t.dtype for t in a_weights.values()} == {torch.float32}
    for name in c_weights:
        torch.testing.assert_close(a_weights[name], c_weights[name], rtol=0, atol=BF16_ATOL)


def _flat(table, column: str) -> torch.Tensor:
    return torch.tensor([x for row in table.column(column).to_pylist() for x in row])


_AT_THE_BOUND = re.compile(r"at the staleness bound \((\d+) groups started\)")


def _held_at_the_bound(queue, ledger, k: int, g: int, since: float, beats: int = 3):
    """(groups started, rollout's policy version) once rollout's heartbeats, `beats` in a row
    written after `since`, say it waits at the staleness bound of its version with the same
    count as the admission ledger: it stopped admitting there. A version the trainer published
    before it stopped may still land in between; rollout then admits up to its new bound and
    the count starts again."""
    deadline = time.time() + 120
    held, seen = None, 0
    while seen < beats:
        beat = next((b for b in queue.heartbeats() if b["role"] == "rollout"), None)
        assert time.time() < deadline, f"rollout never held at the staleness bound: {beat}"
        if beat is None or beat["time"] <= since:
            time.sleep(0.02)
            continue
        since = beat["time"]
        found = _AT_THE_BOUND.match(beat["info"]["state"])
        version = beat["info"].get("policy_version", -1)
        started = ledger.started()
        if found and int(found.group(1)) == started == (version + k + 1) * g:
            seen = seen + 1 if held == (started, version) else 1
            held = (started, version)
        else:
            held, seen = None, 0
    return held


@pytest.mark.slow
def test_a_delayed_trainer_holds_rollout_at_the_staleness_bound(small_config, workdir):
    k, g, steps = 2, 4, 40
    cfg = small_config(
        "d.yaml",
        run_name="d",
        rollout={"max_staleness": k, "groups_per_step": g},
        train={"total_steps": steps, "checkpoint_every": 20},
        algorithm={"is_mode": "tis"},
        services={**ASYNC["services"], "rollout_batch_groups": 2},
        mode="async",
    )
    proc = _run(cfg)
    queue_root = workdir / ".relax" / "queue"
    deadline = time.time() + 300
    trainer_pid, queue = None, None
    while time.time() < deadline and trainer_pid is None:
        runs = os.listdir(queue_root) if queue_root.is_dir() else []
        for run_id in runs:
            queue = TransferQueue(str(queue_root), run_id)
            for beat in queue.heartbeats():
                if beat["role"] == "trainer" and beat["info"].get("policy_version", 0) >= 3:
                    trainer_pid = beat["info"]["pid"]
        time.sleep(0.05)
    assert trainer_pid is not None, "the trainer never reached version 3"
    stopped_at = time.time()
    os.kill(trainer_pid, signal.SIGSTOP)
    try:
        assert not queue.stopped(), "the run ended before the trainer could be delayed"
        ledger = AdmissionLedger(queue)
        # Rollout waits at the bound, saying so in its heartbeat, and admits nothing more.
        held, version = _held_at_the_bound(queue, ledger, k, g, since=stopped_at)
        assert max(ledger.started_by_version()) == version
        assert ledger.started() == held, "rollout kept admitting groups while the trainer slept"
    finally:
        os.kill(trainer_pid, signal.SIGCONT)
    _finish(proc)

    for name in queue.store.list_dir("tickets"):  # the bound held for every admission
        body = json.loads(queue.store.read_bytes(f"tickets/{name}"))
        assert int(name) + body["count"] <= (body["policy_version"] + k + 1) * g
    state = read_state(_final(workdir, "d"))
    staleness = _metrics(workdir, state["tracking_run_id"], "train/staleness_max")
    assert len(staleness) == steps and max(staleness) <= k
    assert max(staleness) >= 1, "rollout never ran ahead of the trainer"


@pytest.mark.slow
def test_all_five_roles_with_partial_rollouts_over_object_store_sync(small_config, workdir):
    cfg = small_config(
        "f.yaml",
        run_name="f",
        rollout={"max_staleness": 1, "partial_rollout": True},
        algorithm={"kl_coef": 0.05, "is_mode": "tis"},
        train={"total_steps": 6, "checkpoint_every": 6},
        services={**ASYNC["services"], "weight_sync": "object_store", "actor_fwd": True},
        mode="async",
    )
    out = _finish(_run(cfg))
    assert "eval accuracy" in out
    ckpt = _final(workdir, "f")
    state = read_state(ckpt)
    roles = _roles(os.path.dirname(ckpt))
    assert sorted(r["role"] for r in roles) == [
        "actor_fwd",
        "advantages",
        "reference",
        "rollout",
        "trainer",
    ]
    queue = TransferQueue(".relax/queue", state["run_id"])
    rows = [queue.read("ready", seq) for seq in queue.committed("ready")]
    for table in rows:
        assert table.column("ref_logprobs").null_count == 0
        assert table.column("old_logprobs").null_count == 0
        lo = table.column("behaviour_version_min").to_pylist()
        hi = table.column("behaviour_version_max").to_pylist()
        assert all(a <= b for a, b in zip(lo, hi, strict=True))
    assert queue.store.list_dir("weights"), "no weights were published to the object store"


def _beats(workdir) -> list[dict]:
    queue_root = workdir / ".relax" / "queue"
    beats = []
    for run_id in os.listdir(queue_root) if queue_root.is_dir() else []:
        beats += TransferQueue(str(queue_root), run_id).heartbeats()
    return beats


SILENCE_S = 15.0
"""services.heartbeat_timeout_s where a test's exact sequence of recoveries is the point: the
silence it induces (SIGSTOP) is unmistakable, and no role of a loaded 2-core box goes this long
without touching its liveness file (MEASURED)."""


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(600)  # eight role processes start, three of them in a whole-run restart
def test_a_silent_or_failing_role_is_recovered_until_the_budget_is_spent(
    small_config, workdir, hook
):
    url, notes = hook
    cfg = small_config(
        "g.yaml",
        run_name="g",
        mode="async",
        rollout={"max_staleness": 1},
        algorithm={"proximal": "behaviour"},
        # Never reached: the run gives up first.
        train={"total_steps": 100000, "checkpoint_every": 50},
        services={
            **ASYNC["services"],
            "heartbeat_timeout_s": SILENCE_S,
            "max_role_restarts": 1,
            "max_global_restarts": 1,
            "notify": url,
        },
    )
    proc = _run(cfg)
    # rollout-0 stopped (silent: restarted in place), killed (its budget spent: the whole run
    # restarts, with a fresh budget per role), killed (in place again), killed: nothing left,
    # the run gives up.
    done: set[int] = set()
    deadline = time.time() + 450
    while len(done) < 4 and proc.poll() is None and time.time() < deadline:
        for beat in _beats(workdir):
            pid = beat["info"].get("pid")
            if beat["role"] != "rollout" or pid in done or beat["info"].get("state") == "stopped":
                continue
            if beat["info"].get("policy_version", 0) < 1:
                continue
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP if not done else signal.SIGKILL)
            done.add(pid)
            break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode != 0, out
    assert "gave up after 1 whole-run restart(s)" in out, out
    assert "rollout-0 (pid" in out and "silent for" in out and "no heartbeat" in out
    assert "-> restarted in place (1/1)" in out and "-> whole run restarted from" in out
    assert "last lines of" in out  # the failing role's log tail
    titles = [n["title"].split("] ", 1)[1] for n in notes]
    assert titles == [
        "rollout-0 restarted",
        "run restarted",
        "rollout-0 restarted",
        "run gave up",
    ], titles
    assert notes[-1]["type"] == "failure" and "rollout-0" in notes[-1]["message"]


@pytest.mark.slow
def test_a_terminated_launcher_stops_every_role(small_config, workdir):
    """SIGTERM to the launcher (a `kill`, a stopped pod) stops the roles it started instead of
    leaving them running without a supervisor."""
    cfg = small_config("t.yaml", run_name="t", **ASYNC, train={"total_steps": 100000})
    proc = _run(cfg)
    deadline, pids = time.time() + 240, {}
    while time.time() < deadline and len(pids) < 3:  # rollout, advantages, trainer
        assert proc.poll() is None, proc.communicate()[0]
        pids = {b["role"]: b["info"]["pid"] for b in _beats(workdir) if b["info"].get("pid")}
        time.sleep(0.2)
    assert len(pids) == 3, pids
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    deadline = time.time() + 10  # an exited role may stay a zombie until it is reaped
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids.values()):
        time.sleep(0.1)
    running = {role: pid for role, pid in pids.items() if os.path.exists(f"/proc/{pid}")}
    assert not running, f"still running after the launcher ended: {running}"
