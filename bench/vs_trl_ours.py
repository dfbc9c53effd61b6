"""bench/vs_trl.py's runs of ours: colocate (the controller's step, timed per phase) and async
(the local supervisor, timed from the trainer's MLflow metrics)."""

from __future__ import annotations

import time
from typing import Any

from bench.vs_trl_report import summarize
from bench.vs_trl_tasks import TASKS, G, bench_config, task_policy

# ---------------------------------------------------------------------------- colocate


class TrainProbe:
    """Times the torch backend's phases inside `train_step`: the log-prob forward, the
    optimizer step (torch's optimizer step hooks), and the step as a whole."""

    def __init__(self, backend) -> None:
        self.t: dict[str, float] = {}
        self._opt_t0 = 0.0
        forward, train_step = backend._forward, backend.train_step

        def timed_forward(mb):
            t0 = time.perf_counter()
            out = forward(mb)
            self.t["forward_s"] = self.t.get("forward_s", 0.0) + time.perf_counter() - t0
            return out

        def timed_train_step(mbs, loss_fn):
            t0 = time.perf_counter()
            out = train_step(mbs, loss_fn)
            self.t["train_step_s"] = self.t.get("train_step_s", 0.0) + time.perf_counter() - t0
            return out

        backend._forward, backend.train_step = timed_forward, timed_train_step
        backend.optimizer.register_step_pre_hook(self._opt_begin)
        backend.optimizer.register_step_post_hook(self._opt_end)

    def _opt_begin(self, *_: Any) -> None:
        self._opt_t0 = time.perf_counter()

    def _opt_end(self, *_: Any) -> None:
        elapsed = time.perf_counter() - self._opt_t0
        self.t["optimizer_s"] = self.t.get("optimizer_s", 0.0) + elapsed

    def take(self) -> dict[str, float]:
        out, self.t = self.t, {}
        return out


def ours_step_parts(m: dict[str, float], probe: dict[str, float], step_s: float) -> dict:
    """One colocate step split into the phases the profile prints (seconds)."""
    forward, opt = probe.get("forward_s", 0.0), probe.get("optimizer_s", 0.0)
    train_step = probe.get("train_step_s", 0.0)
    parts = {
        "generate": m["perf/generate_s"],
        "reward": m["perf/reward_s"],
        "rollout rows (decode, row dicts)": m["perf/rollout_s"] - m["perf/generate_s"]
        - m["perf/reward_s"],
        "queue I/O + advantages": m["perf/queue_s"] + m["perf/ref_s"],
        "Arrow rows -> micro-batch tensors": m["perf/train_s"] - train_step,
        "log-prob forward": forward,
        "loss + backward + grad clip": train_step - forward - opt,
        "optimizer step": opt,
        "weight sync": m["perf/sync_s"],
    }  # fmt: skip
    parts["other"] = step_s - sum(parts.values())
    return {"step_s": step_s, "tokens": m["perf/generated_tokens"], **parts}


def worker_ours(
    task: str, steps: int, eval_every: int, warmup: int, work: str, seed: int = 0
) -> dict:
    from relax_core.heap import freeze_heap
    from relax_core.run.colocate import ColocateController
    from relax_core.run.session import RunSession, RunState

    cfg = bench_config(task, work, steps, eval_every, seed=seed)
    session = RunSession(cfg, task_policy(cfg, task), RunState(run_id=f"vs-trl-{task}"))
    controller = ColocateController(session)
    probe = TrainProbe(session.backend)
    freeze_heap()  # as a run's step loop does (run/lifecycle.run_steps; relax_core/heap.py)
    evals = [(0, controller.evaluate()["eval/accuracy"])]
    records = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        metrics = controller.step()
        step_s = time.perf_counter() - t0
        records.append(ours_step_parts(metrics, probe.take(), step_s))
        if step % eval_every == 0 or step == steps:
            evals.append((step, controller.evaluate()["eval/accuracy"]))
    return summarize(records, evals, warmup, TASKS[task].target)


# ---------------------------------------------------------------------------- async


def worker_async(
    task: str, steps: int, eval_every: int, warmup: int, work: str, seed: int = 0
) -> dict:
    """Our async mode through the local supervisor; per-step figures from the trainer's
    MLflow metrics (`perf/step_s` is the time between the trainer's steps, waits included)."""
    import mlflow

    from relax_core.ops.supervisor import run_async_local
    from relax_core.run.lifecycle import finish_run, start_run
    from relax_core.train.checkpoint import read_state

    cfg = bench_config(task, work, steps, eval_every, mode="async", seed=seed)
    final = run_async_local(cfg, start_run(cfg, task_policy(cfg, task)))
    after = finish_run(cfg, final)["eval_accuracy_after"]
    client = mlflow.tracking.MlflowClient(cfg.tracking.tracking_uri)
    run_id = read_state(final)["tracking_run_id"]
    keys = {
        "step_s": "perf/step_s",
        "length": "train/response_length",
        "trainer wait for ready groups": "perf/trainer_wait_s",
        "train (batching, forward, backward, optimizer)": "perf/train_s",
        "weight sync (gloo broadcast)": "perf/sync_s",
    }
    h = {
        k: {m.step: m.value for m in client.get_metric_history(run_id, key)}
        for k, key in keys.items()
    }
    rows = cfg.rollout.groups_per_step * G
    records = []
    for s in sorted(h["step_s"]):
        record = {k: h[k][s] for k in keys if k != "length"}
        record["tokens"] = h["length"][s] * rows
        records.append(record)
    evals = {m.step: m.value for m in client.get_metric_history(run_id, "eval/accuracy")}
    evals[steps] = after
    return summarize(records, sorted(evals.items()), warmup, TASKS[task].target)
