"""Side by side with TRL's GRPOTrainer: the same model, prompts, reward and GRPO settings.

Per task (`tiny`: configs/cpu-default.yaml's warm-started tiny Qwen3 on 2-digit addition;
`smollm2`: configs/smollm2-135m-cpu.yaml, SmolLM2-135M-Instruct on one-digit sums), both sides
get: the same starting weights (for every seed: the task's policy, warm-started with the
config's own seed), the same prompts in the same order (TRL reads our sampler's order with
`shuffle_dataset=False`), our reward wrapped as a TRL reward function, 8 samples per prompt, the
task's prompts per step, up to 32 new tokens (both stop a row at EOS and a batch when every row
stopped), temperature, lr, AdamW betas (0.9, 0.99), grad clip, the PPO clip (0.2 / 0.28), beta
0, one update per step, token-mean loss (TRL `loss_type="dapo"`, the active tokens of the step
batch), float32 master weights, the run's seed (`--seeds`: it draws the prompt order and the
samples). TRL generates with `transformers` (`use_vllm=False`), no gradient checkpointing, no
eval or checkpoints during training. Ours is the colocate controller (ColocateController.step:
the engine's step with its queue and weight sync) in a process set up as a run's step loop sets
up its own (relax_core/heap.py: the heap frozen, glibc keeping freed memory; TRL's process keeps
glibc's defaults, as TRL leaves them); the async row is `mode: async` with
cpu-async.yaml's services (every role a process, on the same CPU set).

Method: for each round and seed, one A/B pair (ours then TRL, the order alternating from pair
to pair), each run a fresh process, every process of both sides pinned to the same CPU set with
the same torch thread budget (bench.common.run_worker: affinity set before exec, inherited by
the async variant's role processes). Per run: `--steps` steps, the first `--warmup` left out of
the per-step figures (both per task by default); held-out greedy accuracy (our evaluator on
both sides) every `--eval-every` steps, outside the timed steps. Time to accuracy = the summed
step seconds (generation, scoring and training: every second of a step, evals excluded) until
the first eval at or above the task's target.

    python bench/vs_trl.py [--tasks tiny,smollm2] [--seeds 0,1,2] [--rounds 1]
        [--async-tasks tiny] [--cpus 0,1] [--threads 2]

Last lines, per task: `headline: speedup_<task> = X` (median over pairs of TRL s/step / ours
s/step; min-max printed), `headline: speedup_<task>_async = X` for async tasks, and
`headline: time_to_acc_<task> = X` (median over seeds of TRL's time to the target / ours; each
side's seconds printed). TRL is a bench-only dependency: `pip install -e '.[bench]'` (trl
pinned; it must not move torch or transformers).
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
import tempfile

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench.common import add_pin_args, cpu_set, placement, run_worker
from bench.vs_trl_report import print_report, print_run
from bench.vs_trl_tasks import TASKS, bench_config, task_policy

KINDS = ("ours", "trl", "async")


def worker(args) -> None:
    """In the pinned child: one run; its summary as the last line of stdout."""
    from bench.vs_trl_ours import worker_async, worker_ours
    from bench.vs_trl_trl import worker_trl

    fn = {"ours": worker_ours, "trl": worker_trl, "async": worker_async}[args.worker]
    task = args.tasks
    t = TASKS[task]
    steps, every = args.steps or t.steps, args.eval_every or t.eval_every
    warmup = t.warmup if args.warmup is None else args.warmup
    result = fn(task, steps, every, warmup, args.work, args.seed)
    print(json.dumps({**placement(), **result}))


def run_one(kind: str, task: str, seed: int, args, root: str, cpus: list[int]) -> dict:
    work = tempfile.mkdtemp(prefix=f"{kind}-{task}-s{seed}-", dir=root)
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", kind, "--tasks", task,
        "--seed", str(seed), "--work", work,
    ]  # fmt: skip
    for flag in ("steps", "eval_every", "warmup"):
        value = getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag.replace('_', '-')}", str(value)]
    result = run_worker(cmd, cpus, args.threads)
    result.update(seed=seed, load=os.getloadavg()[0])
    print_run(kind, task, result)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default="tiny,smollm2")
    parser.add_argument("--async-tasks", default="tiny", help="tasks that also get an async row")
    parser.add_argument("--seeds", default="0,1,2", help="run seeds (prompt order, samples)")
    parser.add_argument("--rounds", type=int, default=1, help="A/B pairs per seed")
    parser.add_argument("--steps", type=int, help="steps per run (default: per task)")
    parser.add_argument("--eval-every", type=int, help="steps between evals (default: per task)")
    parser.add_argument("--warmup", type=int, help="first steps left out (default: per task)")
    add_pin_args(parser)
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(REPO)
    if args.worker:
        worker(args)
        return
    tasks = args.tasks.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    cpus = cpu_set(args.cpus)
    async_tasks = [t for t in args.async_tasks.split(",") if t in tasks]
    results: dict[str, dict[str, list[dict]]] = {
        t: {k: [] for k in ("ours", "trl") + (("async",) if t in async_tasks else ())}
        for t in tasks
    }
    print(f"CPUs {cpus}, {args.threads} torch threads per process, seeds {seeds}, "
          f"{args.rounds} round(s) per seed", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-vs-trl-") as root:
        for task in tasks:  # prepared once (GGUF conversion, warm start), outside any timing
            task_policy(bench_config(task, root, 1, 1), task)
        pair = 0
        for _ in range(args.rounds):
            for seed in seeds:
                for task in tasks:
                    kinds = list(results[task])
                    if pair % 2:
                        kinds[0], kinds[1] = kinds[1], kinds[0]
                    for kind in kinds:
                        results[task][kind].append(run_one(kind, task, seed, args, root, cpus))
                pair += 1
    print_report(results, args, cpus)


if __name__ == "__main__":
    main()
