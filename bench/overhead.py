"""Engine overhead: the colocate controller's step against a bare PyTorch loop doing its math.

Both sides start from the same warm-started CPU-default policy (bench.common.prepared_policy)
with the same seed. The engine side is `ColocateController.step`; the bare side is
`BareGRPO.step` of bench/bare_grpo.py, which does the engine's math in the engine's order of
operations: the engine's prompt order; one prefill per distinct prompt, indexed out to its
samples, the LM head at the last position only; the engine's sampler (one float64 uniform per
row from a generator seeded alike, inverting the row's CDF); finished rows leaving the decode
batch once they are a quarter of it (so both draw the same uniforms); token-budget
micro-batches packed longest row first; each micro-batch's distinct prompts run once with their
keys/values indexed out to every row; the LM head on real response tokens only; token-mean loss
over the step batch's tokens; GRPO advantages (population std, eps 1e-6); PPO clip (eps_clip,
eps_clip_high); the config's reward function; AdamW (0.9, 0.99, no weight decay); grad clip.

What the bare loop still does not do (none of it changes the update):
- one model samples and trains; the engine samples with a copy and copies the trained weights
  into it after each step (weight sync);
- no attention masks or position ids: every prompt has one length and responses are
  right-padded under causal attention, so padding never reaches a real token (the engine builds
  both, and passes masks to every forward);
- none of the engine's bookkeeping: rollout log-probs, per-token entropy (computed, unused by a
  loss without an entropy term), the rollout-vs-train mismatch and loss metrics, row dicts and
  reward error handling, Arrow rows written to the queue and read back (`rollout`, `ready`),
  schema checks, staleness and proximal-policy plumbing, the non-finite grad-norm skip.
`--check K` runs both sides K steps in one process from the same weights and prints, per step,
both mean rewards and the largest parameter difference: 0 when the two do the same operations
(as at the commit that wrote this), ~1e-3 and growing once a sample or an update differs, which
is how an engine change that the bare loop has not followed shows.

Method: each side runs `--steps` timed steps after `--warmup` untimed ones in a fresh process
of its own per round, every process pinned to the same CPU set with the same torch thread
budget (bench.common.run_worker); engine first in odd rounds, bare first in even ones.

    python bench/overhead.py [--steps 20] [--warmup 2] [--rounds 3] [--cpus 0,1] [--threads 2]
    python bench/overhead.py --check 3

Last line: `headline: engine_overhead = X`, the median over rounds of engine s/step / bare
s/step (goal <= 1.2).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue` (imported by torch, s3fs and concurrent.futures): put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import json
import shutil
import statistics
import tempfile
import time

from bench.common import (
    add_pin_args,
    cpu_set,
    median_range,
    placement,
    prepared_policy,
    repo_data,
    run_worker,
    work_sections,
)

SIDES = ("engine", "bare")


def bench_config(work: str):
    """The CPU default with its queue, checkpoints and MLflow store under `work`."""
    from relax_core.config import load_config, replace

    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    return replace(cfg, **work_sections(work), **repo_data(cfg), train={"total_steps": 10_000})


def engine_side(cfg, policy: str):
    """A colocate controller on `policy` (its session holds the trainer's model)."""
    from relax_core.run.colocate import ColocateController
    from relax_core.run.session import RunSession
    from relax_core.train.run_state import RunState

    return ColocateController(RunSession(cfg, policy, RunState(run_id="bench-overhead")))


def engine_phases(controller):
    """The controller's step, returning the step's phase times (perf/*_s)."""

    def step() -> dict[str, float]:
        m = controller.step()
        return {k[5:]: v for k, v in m.items() if k.startswith("perf/") and k.endswith("_s")}

    return step


def bare_side(cfg, policy: str):
    from bench.bare_grpo import BareGRPO
    from relax_core.data.dataset import load_prompts
    from relax_core.models.policy import load_policy
    from relax_core.rewards.registry import resolve_reward

    model, tok = load_policy(policy)
    rows = load_prompts(cfg.data.train_path)
    return BareGRPO(model, tok, rows, cfg, cfg.seed, resolve_reward(cfg.reward.name))


def worker(side: str, steps: int, warmup: int, **sections: dict) -> None:
    """Time `steps` steps of one side after `warmup` steps; print the result as JSON.
    `sections`: settings over the config's, applied after its starting policy is prepared (so
    both sides of a bench start from the same weights)."""
    from relax_core.config import replace
    from relax_core.heap import freeze_heap

    work = tempfile.mkdtemp(prefix="relax-overhead-")
    try:
        cfg = bench_config(work)
        policy = prepared_policy(cfg)
        cfg = replace(cfg, **sections) if sections else cfg
        if side == "engine":
            step = engine_phases(engine_side(cfg, policy))
        else:
            step = bare_side(cfg, policy).step
        # Both sides' processes set up as a run's step loop sets up its own (the heap frozen,
        # glibc keeping freed memory: relax_core/heap.py), so the ratio is the engine's work.
        freeze_heap()
        for _ in range(warmup):
            step()
        parts: dict[str, float] = {}
        t0 = time.perf_counter()
        for _ in range(steps):
            for key, value in step().items():
                if key.endswith("_s") and key != "tokens_per_s":
                    parts[key] = parts.get(key, 0.0) + value / steps
        s_per_step = (time.perf_counter() - t0) / steps
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({**placement(), "side": side, "s_per_step": s_per_step, "parts": parts}))


def step_ab(script: str, sides: tuple[str, str], args, setting: str, headline: str) -> None:
    """A bench of one setting's cost on the engine's step (`script`'s workers run `worker` with
    `setting` per side): the config's policy prepared once here, so no worker times the warm
    start; then `args.rounds` A/B pairs of `script --worker <side> --steps --warmup`, each a
    fresh process pinned to `args.cpus` with `args.threads`, the order alternating from round
    to round. Prints each round, each side's median (min-max) s/step and last `headline: <name>
    = X`, the median over rounds of the first side's s/step over the second's."""
    cpus = cpu_set(args.cpus)
    work = tempfile.mkdtemp(prefix="relax-step-ab-")
    prepared_policy(bench_config(work))
    shutil.rmtree(work, ignore_errors=True)
    per_step: dict[str, list[float]] = {side: [] for side in sides}
    ratios = []
    for r in range(args.rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            cmd = [sys.executable, os.path.abspath(script), "--worker", side]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            per_step[side].append(run_worker(cmd, cpus, args.threads)["s_per_step"])
        a, b = (per_step[side][-1] for side in sides)
        ratios.append(a / b)
        print(f"round {r + 1}: {sides[0]} {a:.4f} s/step, {sides[1]} {b:.4f} s/step, "
              f"{sides[0]} / {sides[1]} {ratios[-1]:.3f}", flush=True)  # fmt: skip
    print(f"\nCPUs {cpus}; {args.threads} torch threads per process; {args.steps} timed steps "
          f"after {args.warmup}; {args.rounds} rounds, the order alternating")  # fmt: skip
    for side in sides:
        print(f"{setting} {side}: {median_range(per_step[side], 4)} s/step")
    print(f"{sides[0]} / {sides[1]} per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    print(f"headline: {headline} = {statistics.median(ratios):.2f}")


def check(steps: int) -> None:
    """Both sides from the same weights in this process: per step, the mean rewards and the
    largest difference between the trainer's parameters and the bare loop's."""
    work = tempfile.mkdtemp(prefix="relax-overhead-")
    try:
        cfg = bench_config(work)
        policy = prepared_policy(cfg)
        controller, bare = engine_side(cfg, policy), bare_side(cfg, policy)
        start = [p.detach().clone() for p in bare.model.parameters()]
        print("step  engine reward  bare reward  max |param diff|  max |bare param moved|")
        same = True
        for k in range(1, steps + 1):
            reward = controller.step()["train/reward_mean"]
            bare_reward = bare.step()["reward_mean"]
            ours = [p.detach() for p in controller.s.model.parameters()]
            theirs = [p.detach() for p in bare.model.parameters()]
            diff = max(float((p - q).abs().max()) for p, q in zip(ours, theirs, strict=True))
            moved = max(float((p - q).abs().max()) for p, q in zip(theirs, start, strict=True))
            print(f"{k:>4}  {reward:>13.4f}  {bare_reward:>11.4f}  {diff:>16.2e}  {moved:>21.2e}")
            same = same and abs(reward - bare_reward) < 1e-6 and diff < 1e-4
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not same:
        raise SystemExit("the bare loop's math differs from the engine's (see above)")
    print("same samples and updates, up to float rounding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per process")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", type=int, default=0, help="compare K steps' math, no timing")
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    add_pin_args(parser)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps, args.warmup)
    if args.check:
        return check(args.check)
    cpus = cpu_set(args.cpus)
    work = tempfile.mkdtemp(prefix="relax-overhead-")
    cfg = bench_config(work)
    prepared_policy(cfg)  # the warm start once, here, so no worker times it
    shutil.rmtree(work, ignore_errors=True)
    script = os.path.abspath(__file__)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in SIDES if r % 2 == 0 else SIDES[::-1]:  # a drifting machine favours neither
            cmd = [sys.executable, script, "--worker", side]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            results[side].append(run_worker(cmd, cpus, args.threads))
        e, b = (results[side][-1]["s_per_step"] for side in SIDES)
        print(f"round {r + 1}: engine {e:.4f} s/step, bare {b:.4f} s/step", flush=True)
    per_step = {side: [x["s_per_step"] for x in results[side]] for side in SIDES}
    ratios = [e / b for e, b in zip(per_step["engine"], per_step["bare"], strict=True)]
    print(f"\nseed {cfg.seed}; CPUs {cpus}; {args.threads} torch threads per process; "
          f"{args.steps} timed steps after {args.warmup} per process; {args.rounds} rounds")  # fmt: skip
    print("\n| side | s/step median (min-max) |\n| --- | --- |")
    for side in SIDES:
        print(f"| {side} | {median_range(per_step[side], 4)} |")
    print(f"engine / bare per round: {', '.join(f'{x:.3f}' for x in ratios)}")
    for side in SIDES:
        parts = results[side][-1]["parts"]
        print(f"{side} phases (last round, s/step): "
              + ", ".join(f"{k}={v:.4f}" for k, v in sorted(parts.items())))  # fmt: skip
    print(f"headline: engine_overhead = {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
