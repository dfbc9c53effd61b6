"""Side by side with TRL's GRPOTrainer: the same model, prompts, reward and GRPO settings.

Per task (`tiny`: configs/cpu-default.yaml's warm-started tiny Qwen3 on 2-digit addition;
`smollm2`: configs/smollm2-135m-cpu.yaml, SmolLM2-135M-Instruct on one-digit sums), both sides
get: the same starting weights, the same prompts in the same order (TRL reads our sampler's
order with `shuffle_dataset=False`), our reward wrapped as a TRL reward function, 8 samples per
prompt, the task's prompts per step, up to 32 new tokens (both stop a row at EOS and a batch
when every row stopped), temperature, lr, AdamW betas (0.9, 0.99), grad clip, the PPO clip
(0.2 / 0.28), beta 0, one update per step, token-mean loss (TRL `loss_type="dapo"`, the active
tokens of the step batch), float32, seed 0. TRL generates with `transformers` (`use_vllm=False`),
no gradient checkpointing, no eval or checkpoints during training. Ours is the colocate
controller (ColocateController.step, the engine's step with its queue, fsync and weight sync);
the async row is `mode: async` with cpu-async.yaml's services (every role a process).

Every run is its own process; ours and TRL alternate A B A B. Per run: `--steps` steps, the
first `--warmup` left out of the per-step figures (both per task by default); held-out greedy
accuracy (our evaluator on both sides) every `--eval-every` steps, outside the timed steps.
Time to target = summed step seconds until the first eval at or above the target. Torch runs
1 thread per process by default (`--threads`): see bench/RESULTS.md for why.

    python bench/vs_trl.py [--tasks tiny,smollm2] [--rounds 2] [--async-tasks tiny,smollm2]

Last lines: `headline: speedup_tiny = X` and `headline: speedup_smollm2 = Y` (TRL seconds per
step / ours, colocate, median over rounds). TRL is a bench-only dependency: `pip install -e
'.[bench]'` (trl pinned; it must not move torch or transformers).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue`: put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

G = 8  # samples per prompt (group size)
NEW_TOKENS = 32


@dataclass(frozen=True)
class Task:
    cfg: str
    steps: int
    eval_every: int
    target: float
    """Held-out greedy accuracy whose first crossing times `time to target`."""
    warmup: int
    """First steps left out of the per-step figures."""


TASKS = {
    "tiny": Task("configs/cpu-default.yaml", steps=50, eval_every=10, target=0.30, warmup=2),
    "smollm2": Task("configs/smollm2-135m-cpu.yaml", steps=4, eval_every=2, target=0.9, warmup=1),
}
ASYNC_FIELDS = {"services", "rollout.max_staleness", "algorithm.proximal"}


def bench_config(task: str, work: str, steps: int, eval_every: int, mode: str = "colocate"):
    """The task's config with the bench's shape: 32 new tokens, paths under `work`."""
    from relax_core.config import load_config, replace

    cfg = load_config(os.path.join(REPO, TASKS[task].cfg))
    over: dict[str, Any] = {}
    if mode == "async":
        # The async variant of this task: cpu-async.yaml's role layout and stale-row handling.
        a = load_config(os.path.join(REPO, "configs", "cpu-async.yaml"))
        over = {
            "mode": "async",
            "services": {
                "launch": a.services.launch,
                "weight_sync": a.services.weight_sync,
                "rollout_threads": a.services.rollout_threads,
                "trainer_threads": a.services.trainer_threads,
            },
            "algorithm": {"proximal": a.algorithm.proximal},
        }
    return replace(
        cfg,
        run_name=f"vs-trl-{task}-{mode}",
        rollout={
            "max_new_tokens": NEW_TOKENS,
            "n_samples_per_prompt": G,
            **({"max_staleness": 1} if mode == "async" else {}),
        },
        train={
            "total_steps": steps,
            "eval_every": eval_every,
            "checkpoint_every": 10_000,
            "steps_per_node": 10_000,
        },
        queue={"root": os.path.join(work, "queue")},
        checkpoint={
            "dir": os.path.join(work, "checkpoints"),
            "policy_cache_dir": os.path.join(REPO, ".relax", "policies"),
        },
        tracking={
            "tracking_uri": f"sqlite:///{work}/mlflow.db",
            "progress": False,
            "experiment": "bench-vs-trl",
            "registered_model": "",
        },
        data={
            "train_path": os.path.join(REPO, cfg.data.train_path),
            "eval_path": os.path.join(REPO, cfg.data.eval_path),
        },
        **over,
    )


def prepared_policy(cfg) -> str:
    from relax_core.data.dataset import fingerprint
    from relax_core.models.policy import PolicySpec, prepare_policy

    spec = PolicySpec.of(cfg, fingerprint(cfg.data.train_path))
    return prepare_policy(spec, cfg.checkpoint.policy_cache_dir)


def summarize(steps: list[dict[str, float]], evals: list, warmup: int, target: float) -> dict:
    """Per-step medians past the warm-up, tokens/s, the eval curve and the time to target.

    `evals`: (step, accuracy) pairs; `steps[i]["step_s"]` is step i+1's seconds."""
    timed = steps[warmup:]
    # Phases as means (they add up to the mean step); the step itself also as a median.
    parts = {k: statistics.mean(s[k] for s in timed) for k in timed[0]}
    elapsed = [sum(s["step_s"] for s in steps[:n]) for n in range(len(steps) + 1)]
    reach = next((elapsed[s] for s, acc in evals if s > 0 and acc >= target - 1e-9), None)
    return {
        "s_per_step": statistics.median(s["step_s"] for s in timed),
        "tokens_per_step": statistics.mean(s["tokens"] for s in timed),
        "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed),
        "parts": parts,
        "evals": evals,
        "time_to_target": reach,
        "train_s": elapsed[-1],
    }


# ---------------------------------------------------------------------------- ours, colocate


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


def worker_ours(task: str, steps: int, eval_every: int, warmup: int, work: str) -> dict:
    from relax_core.services.colocate import ColocateController
    from relax_core.services.session import RunSession, RunState

    cfg = bench_config(task, work, steps, eval_every)
    session = RunSession(cfg, prepared_policy(cfg), RunState(run_id=f"vs-trl-{task}"))
    controller = ColocateController(session)
    probe = TrainProbe(session.backend)
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


# ---------------------------------------------------------------------------- TRL


def trl_dataset(cfg, tokenizer, n_prompts: int):
    """Our sampler's first `n_prompts` prompts, in order, rendered exactly as our engine sees
    them (checked token for token)."""
    from datasets import Dataset
    from relax_core.data.cursor import DatasetCursor
    from relax_core.data.templates import render_prompt
    from relax_core.services.media import prompt_source

    source = prompt_source(cfg, "train", None, tokenizer)
    items, _ = source.take(DatasetCursor(), n_prompts)
    d = cfg.data
    texts = [
        render_prompt(i.row["prompt"], d.template, tokenizer, d.system_prompt or None)
        for i in items
    ]
    for text, item in zip(texts, items, strict=True):
        if tokenizer(text)["input_ids"] != item.prompt_ids:
            raise RuntimeError(f"TRL would tokenize {text!r} differently from our engine")
    return Dataset.from_list(
        [{"prompt": t, "row": i.prompt_index} for t, i in zip(texts, items, strict=True)]
    ), source.rows


def trl_reward(reward_fn, rows: list[dict]):
    """Our reward as a TRL reward function (completions are decoded without special tokens on
    both sides)."""
    from relax_core.rewards import score_batch

    def math_reward(prompts, completions, row, **_: Any) -> list[float]:
        samples = [rows[i] for i in row]
        results, _ = score_batch(reward_fn, completions, [s["answer"] for s in samples], samples)
        return [r.reward for r in results]

    return math_reward


def trl_args(cfg, work: str, steps: int):
    from trl import GRPOConfig

    a, t, r = cfg.algorithm, cfg.train, cfg.rollout
    return GRPOConfig(
        output_dir=os.path.join(work, "trl"),
        max_steps=steps,
        per_device_train_batch_size=r.groups_per_step * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        temperature=r.temperature,
        top_p=r.top_p,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",  # torch.optim.AdamW, as ours (TRL's default on CPU is the fused one)
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        beta=0.0,
        epsilon=a.eps_clip,
        epsilon_high=a.eps_clip_high,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group" if a.normalize_adv_std else "none",
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        shuffle_dataset=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def worker_trl(task: str, steps: int, eval_every: int, warmup: int, work: str) -> dict:
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from relax_core.models.policy import load_policy
    from relax_core.rewards.registry import build_reward
    from relax_core.rollout.torch_engine import TorchEngine
    from relax_core.services.evaluation import evaluate
    from relax_core.services.media import prompt_source

    cfg = bench_config(task, work, steps, eval_every)
    model, tokenizer = load_policy(prepared_policy(cfg), cfg.model.dtype)
    data, rows = trl_dataset(cfg, tokenizer, steps * cfg.rollout.groups_per_step)
    reward_fn = build_reward(cfg.reward)
    eval_source = prompt_source(cfg, "eval", None, tokenizer)

    def held_out() -> float:
        engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
        try:
            return evaluate(
                engine, tokenizer, eval_source, reward_fn, NEW_TOKENS, cfg.data.eval_size
            )["eval/accuracy"]
        finally:
            model.train()

    class Timed(GRPOTrainer):
        """Times TRL's generation and its generate-and-score phase; counts sampled tokens."""

        probe: dict[str, float] = {}

        def _generate_single_turn(self, *args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.probe["generate"] = self.probe.get("generate", 0.0) + time.perf_counter() - t0
            return out

        def compute_loss(self, *args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            out = super().compute_loss(*args, **kwargs)
            self.probe["loss"] = self.probe.get("loss", 0.0) + time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.probe["rollout"] = self.probe.get("rollout", 0.0) + time.perf_counter() - t0
            self.probe["tokens"] = float(out["completion_mask"].sum())
            return out

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.records: list[dict[str, float]] = []
            self.evals = [(0, held_out())]
            self.last = self.opt0 = self.opt = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                self.last = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.opt0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.opt = time.perf_counter() - self.opt0

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            p, step_s = trainer.probe, now - self.last
            self.records.append(trl_step_parts(p, self.opt, step_s))
            trainer.probe = {}
            s = state.global_step
            if s % eval_every == 0 or s == steps:
                self.evals.append((s, held_out()))
            self.last = time.perf_counter()

    torch.manual_seed(cfg.seed)
    clock = Clock()
    trainer = Timed(
        model=model,
        reward_funcs=trl_reward(reward_fn, rows),
        args=trl_args(cfg, work, steps),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    result = summarize(clock.records, clock.evals, warmup, TASKS[task].target)
    result["optimizer"] = str(trainer.args.optim)
    return result


def trl_step_parts(probe: dict[str, float], opt: float, step_s: float) -> dict[str, float]:
    gen, rollout = probe.get("generate", 0.0), probe.get("rollout", 0.0)
    loss = probe.get("loss", 0.0)
    parts = {
        "generate": gen,
        "reward + advantages + padding": rollout - gen,
        "log-prob forward + loss": loss,
        "backward + grad clip + Trainer loop": step_s - rollout - loss - opt,
        "optimizer step": opt,
    }
    return {"step_s": step_s, "tokens": probe.get("tokens", 0.0), **parts}


# ---------------------------------------------------------------------------- ours, async


def worker_async(task: str, steps: int, eval_every: int, warmup: int, work: str) -> dict:
    """Our async mode through the local supervisor; per-step figures from the trainer's
    MLflow metrics (`perf/step_s` is the time between the trainer's steps, waits included)."""
    import mlflow

    from relax_core.services.run import finish_run, start_run
    from relax_core.services.supervisor import run_async_local
    from relax_core.train.checkpoint import read_state

    cfg = bench_config(task, work, steps, eval_every, mode="async")
    final = run_async_local(cfg, start_run(cfg, prepared_policy(cfg)))
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


WORKERS = {"ours": worker_ours, "trl": worker_trl, "async": worker_async}


# ---------------------------------------------------------------------------- driver


def run_worker(kind: str, task: str, args, work: str) -> dict:
    """One run in a fresh process (same threads and memory state for every run)."""
    out = os.path.join(work, f"{kind}-{task}.json")
    command = [
        sys.executable, os.path.abspath(__file__), "--worker", kind, "--tasks", task,
        "--steps", str(args.steps[task]), "--eval-every", str(args.eval_every[task]),
        "--warmup", str(args.warmup[task]), "--threads", str(args.threads), "--work", work,
        "--out", out,
    ]  # fmt: skip
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{kind} {task} failed:\n{done.stderr[-6000:]}")
    with open(out) as f:
        result = json.load(f)
    result["wall_s"] = time.perf_counter() - t0
    result["load"] = (load0, os.getloadavg()[0])
    curve = " ".join(f"{s}:{a:.2f}" for s, a in result["evals"])
    print(
        f"[{kind:>5} {task}] {result['s_per_step']:.3f} s/step, {result['tokens_per_step']:.0f} "
        f"tokens/step, {result['tokens_per_s']:.0f} tokens/s, evals {curve}, process "
        f"{result['wall_s']:.0f} s, load average {result['load'][0]:.1f} -> {result['load'][1]:.1f}",
        flush=True,
    )
    return result


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def print_report(results: dict[str, dict[str, list[dict]]], args) -> None:
    threads = args.threads or f"torch's default ({os.cpu_count()} cores)"
    print(
        f"\ntorch threads: {threads}; rounds: {args.rounds}; warm-up steps left out: "
        + ", ".join(f"{t} {n}" for t, n in args.warmup.items())
    )
    print(
        f"{'task':<8} {'run':<14} {'s/step':>8} {'tokens/step':>12} {'tokens/s':>9} "
        f"{'target':>7} {'time to target':>15} {'speedup':>8}"
    )
    headlines = []
    for task, by_kind in results.items():
        trl_s = median_of(by_kind["trl"], "s_per_step")
        for kind, runs in by_kind.items():
            s = median_of(runs, "s_per_step")
            reach = median_of(runs, "time_to_target")
            reached = sum(r["time_to_target"] is not None for r in runs)
            label = {"ours": "ours colocate", "async": "ours async", "trl": "TRL"}[kind]
            reach_text = f"{reach:.1f} s ({reached}/{len(runs)})" if reach else f"- (0/{len(runs)})"
            print(
                f"{task:<8} {label:<14} {s:>8.3f} {median_of(runs, 'tokens_per_step'):>12.0f} "
                f"{median_of(runs, 'tokens_per_s'):>9.0f} {TASKS[task].target:>7.2f} "
                f"{reach_text:>15} {trl_s / s:>7.2f}x"
            )
        ours = median_of(by_kind["ours"], "s_per_step")
        headlines.append(f"headline: speedup_{task} = {trl_s / ours:.2f}")
        if "async" in by_kind:
            a = median_of(by_kind["async"], "s_per_step")
            headlines.append(f"headline: speedup_{task}_async = {trl_s / a:.2f}")
    for task, by_kind in results.items():
        for kind in ("ours", "trl"):
            print_profile(task, kind, by_kind[kind])
    print()
    print("\n".join(headlines))


def print_profile(task: str, kind: str, runs: list[dict]) -> None:
    """Mean seconds per phase over a run's timed steps (median over runs), and its share."""
    name = "ours (colocate)" if kind == "ours" else "TRL GRPOTrainer"
    step = statistics.median(r["parts"]["step_s"] for r in runs)
    print(f"\nwhere the step goes, {task}, {name}: {step:.3f} s/step (mean)")
    for key in runs[0]["parts"]:
        if key in ("step_s", "tokens"):
            continue
        v = statistics.median(r["parts"][key] for r in runs)
        print(f"  {key:<48} {v:8.4f} s  {v / step:6.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="tiny,smollm2")
    parser.add_argument(
        "--async-tasks", default="tiny,smollm2", help="tasks that also get an async row"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, help="steps per run (default: per task)")
    parser.add_argument("--eval-every", type=int, help="steps between evals (default: per task)")
    parser.add_argument("--warmup", type=int, help="first steps left out (default: per task)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads of ours and TRL (0: torch's default). 1 by default: on a shared "
        "machine 2-thread steps swing 10-30x with other jobs (bench/RESULTS.md)",
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(REPO)
    tasks = args.tasks.split(",")
    if args.worker:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        task = tasks[0]
        steps = args.steps or TASKS[task].steps
        every = args.eval_every or TASKS[task].eval_every
        warmup = TASKS[task].warmup if args.warmup is None else args.warmup
        result = WORKERS[args.worker](task, steps, every, warmup, args.work)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return
    args.steps = {t: args.steps or TASKS[t].steps for t in tasks}
    args.eval_every = {t: args.eval_every or TASKS[t].eval_every for t in tasks}
    args.warmup = {t: TASKS[t].warmup if args.warmup is None else args.warmup for t in tasks}
    async_tasks = [t for t in args.async_tasks.split(",") if t in tasks]
    results: dict[str, dict[str, list[dict]]] = {
        t: {k: [] for k in ("ours", "trl") + (("async",) if t in async_tasks else ())}
        for t in tasks
    }
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as root:
        for task in tasks:  # prepared once (GGUF conversion, warm start), outside any timing
            prepared_policy(bench_config(task, root, 1, 1))
        for r in range(args.rounds):
            for task in tasks:
                for kind in results[task]:
                    if kind == "async" and r > 0:
                        continue  # one async run per task: its row is a systems check
                    work = tempfile.mkdtemp(prefix=f"{kind}-{task}-{r}-", dir=root)
                    results[task][kind].append(run_worker(kind, task, args, work))
    print_report(results, args)


if __name__ == "__main__":
    main()
