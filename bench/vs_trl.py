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
# library's `queue`: put the repo there instead (bench's own modules are then `bench.*`).
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import json
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import prepared_policy
from bench.vs_trl_ours import worker_async, worker_ours
from bench.vs_trl_report import print_report, print_run
from bench.vs_trl_tasks import TASKS, bench_config
from bench.vs_trl_trl import worker_trl

WORKERS = {"ours": worker_ours, "trl": worker_trl, "async": worker_async}


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
    print_run(kind, task, result)
    return result


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
