"""LoRA vs full weights on SmolLM2-135M-Instruct on CPU: seconds per step, peak memory and bytes
per weight sync, side by side in one run.

Each round runs `configs/smollm2-135m-cpu.yaml` (full weights) and
`configs/smollm2-135m-lora-cpu.yaml` (rank-16 adapters) for `--steps` steps, each as one child
`python -m relax_core.entrypoints.run --cfg <yaml>` (colocate: start, steps and finish in that one
process), in a fresh work directory, alternating which side goes first. This process pins itself
to `--cpus` before starting anything, so both sides' processes run on that CPU set, with the same
torch thread count. Both start from the same cached policy (converted from the GGUF before any
timing; round r uses seed r on both sides); evals at step 0 and at the end, one checkpoint at the
end.

Per side-run: seconds per step (median of the run's `perf/step_s` in its MLflow store, the first
step left out as warm-up), the generate / train / sync split, peak RSS (the child's ru_maxrss from
wait4; /proc is polled too, to check that the run stays one process on the CPU set), and the
reward per step. Bytes per weight sync are measured once per side, after round 1: the run's
final checkpoint is loaded as a RunSession and its trainer's `named_weights()`, the iterator each
colocate step hands to the in-process sync, is summed (numel x element size).

    python bench/lora.py [--rounds 3] [--steps 8] [--cpus 0,1] [--threads 0]

Last lines: `headline: lora_vs_full_peak_rss_ratio = Y` (full / LoRA),
`headline: lora_vs_full_sync_bytes_ratio = Z` (full / LoRA) and
`headline: lora_vs_full_step_speedup = X` (full s/step / LoRA s/step, median of the per-round
ratios).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import glob
import json
import statistics
import subprocess
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import prepared_policy, repo_data, start_local_run, work_sections

SIDES = {
    "full": os.path.join(REPO, "configs", "smollm2-135m-cpu.yaml"),
    "lora": os.path.join(REPO, "configs", "smollm2-135m-lora-cpu.yaml"),
}
PER_STEP = ("perf/step_s", "perf/generate_s", "perf/train_s", "perf/sync_s")
SYNC_BYTES = (
    "import json, sys; from relax_core.roles.service import load_run_config; "
    "from relax_core.run.session import RunSession; "
    "s = RunSession.from_checkpoint(load_run_config(sys.argv[1]), sys.argv[2]); "
    "w = list(s.backend.named_weights()); "
    "print(json.dumps({'tensors': len(w), 'bytes': sum(t.numel() * t.element_size() for _, t in w)}))"
)
"""What a colocate step pushes to the engine (`s.sync.push(s.backend.named_weights(), v)`)."""


def _config(path: str, work: str, steps: int, seed: int, threads: int):
    from relax_core.config import load_config, replace

    cfg = load_config(path)
    return replace(
        cfg,
        seed=seed,
        train={
            "total_steps": steps,
            "eval_every": 0,
            "checkpoint_every": steps,
            "steps_per_node": steps,
            "torch_threads": threads,
        },
        **work_sections(work, experiment="bench-lora"),
        **repo_data(cfg),
    )


def write_yaml(cfg, path: str) -> str:
    """`cfg` as the YAML file the run entrypoint's `--cfg` reads; returns `path`. Not JSON: the
    entrypoint reads YAML, which takes JSON's `5e-06` (train.lr here) for a string."""
    import yaml

    from relax_core.config import config_to_dict

    with open(path, "w") as f:
        yaml.safe_dump(config_to_dict(cfg), f)
    return path


def _tree(pid: int) -> tuple[int, int, set[int]]:
    """(RSS bytes summed over the process and its descendants, how many descendants, the CPUs
    they may run on)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
        rss = sum(p.memory_info().rss for p in procs)
        cpus = set().union(*(p.cpu_affinity() for p in procs))
        return rss, len(procs) - 1, cpus
    except psutil.Error:
        return 0, 0, set()


def run_side(cfg, work: str, name: str) -> dict:
    cfg_path = write_yaml(cfg, os.path.join(work, f"{name}.yaml"))
    log_path = os.path.join(work, f"{name}.log")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = start_local_run(cfg_path, log_path)
    polled_rss, children, cpus = 0, 0, set()
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        rss, n, on = _tree(proc.pid)
        polled_rss, children, cpus = max(polled_rss, rss), max(children, n), cpus | on
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped by wait4 above
    if proc.returncode:
        with open(log_path) as f:
            raise SystemExit(f"{name} run failed ({proc.returncode}):\n{f.read()[-4000:]}")
    res = _metrics(cfg)
    res.update(
        wall_s=wall,
        peak_rss_mb=usage.ru_maxrss / 1024,  # kilobytes on Linux
        polled_rss_mb=polled_rss / 2**20,
        children=children,
        cpus=sorted(cpus),
        load=(load0, os.getloadavg()[0]),
    )
    return res


def _metrics(cfg) -> dict:
    import mlflow

    client = mlflow.tracking.MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id])

    def history(key: str) -> list[float]:
        found = client.get_metric_history(run.info.run_id, key)
        return [m.value for m in sorted(found, key=lambda m: m.step)]

    steps = {key: history(key)[1:] for key in PER_STEP}
    accuracy = history("eval/accuracy")
    return {
        "per_step": {key: statistics.median(v) for key, v in steps.items()},
        "steps_s": steps["perf/step_s"],
        "reward": history("train/reward_mean"),
        "tokens": statistics.median(history("perf/generated_tokens")),
        "accuracy": (accuracy[0], accuracy[-1]),
    }


def sync_bytes(cfg, work: str) -> dict:
    """Bytes the trainer hands the weight sync per step, from the run's final checkpoint (in a
    child, so this process stays small)."""
    (summary,) = glob.glob(os.path.join(cfg.checkpoint.dir, "*", "summary.json"))
    with open(summary) as f:
        checkpoint = json.load(f)["checkpoint"]
    cfg_path = write_yaml(cfg, os.path.join(work, "sync.yaml"))
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run(
        [sys.executable, "-c", SYNC_BYTES, cfg_path, checkpoint],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
    )
    if out.returncode:
        raise SystemExit(f"sync bytes failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _ratios(full: list[dict], lora: list[dict], of) -> list[float]:
    """full / LoRA of `of(run)`, round by round."""
    return [of(f) / of(lo) for f, lo in zip(full, lora, strict=True)]


def _span(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def _report(name: str, r: int, res: dict) -> None:
    p = res["per_step"]
    print(
        f"[round {r + 1} {name}] s/step {p['perf/step_s']:.2f} (generate "
        f"{p['perf/generate_s']:.2f}, train {p['perf/train_s']:.2f}, sync "
        f"{p['perf/sync_s'] * 1000:.1f} ms), tokens/step {res['tokens']:.0f}, peak RSS "
        f"{res['peak_rss_mb']:.0f} MB (polled {res['polled_rss_mb']:.0f} MB, "
        f"{res['children']} child processes, cpus {res['cpus']}), wall {res['wall_s']:.0f} s, "
        f"load {res['load'][0]:.1f}->{res['load'][1]:.1f}",
        flush=True,
    )
    print(
        f"    reward per step: {' '.join(f'{x:.2f}' for x in res['reward'])}; held-out "
        f"accuracy {res['accuracy'][0]:.2f} -> {res['accuracy'][1]:.2f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="RL steps per side-run")
    parser.add_argument("--cpus", default="0,1", help="CPU set every process runs on")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: one per CPU)")
    parser.add_argument("--keep", help="keep run directories under this path (default: temp)")
    args = parser.parse_args()
    cpus = {int(c) for c in args.cpus.split(",")}
    os.sched_setaffinity(0, cpus)  # inherited by every child of both sides
    threads = args.threads or len(cpus)
    with tempfile.TemporaryDirectory(prefix="bench-lora-", dir=args.keep) as work:
        for r in range(args.rounds):  # conversion before any timing; the cache is keyed on seed
            prepared_policy(_config(SIDES["full"], work, args.steps, r, threads))
    results: dict[str, list[dict]] = {name: [] for name in SIDES}
    synced: dict[str, dict] = {}
    for r in range(args.rounds):
        order = list(SIDES) if r % 2 == 0 else list(reversed(SIDES))
        for name in order:
            with tempfile.TemporaryDirectory(prefix=f"bench-lora-{name}-", dir=args.keep) as work:
                cfg = _config(SIDES[name], work, args.steps, r, threads)
                results[name].append(run_side(cfg, work, name))
                _report(name, r, results[name][-1])
                if name not in synced:
                    synced[name] = sync_bytes(cfg, work)
                    print(f"    bytes per weight sync: {synced[name]}", flush=True)
    _summary(args, threads, results, synced)


def _summary(args, threads: int, results: dict[str, list[dict]], synced: dict) -> None:
    full, lora = results["full"], results["lora"]
    speedups = _ratios(full, lora, lambda x: x["per_step"]["perf/step_s"])
    rss = _ratios(full, lora, lambda x: x["peak_rss_mb"])
    print(
        f"\ncpus {args.cpus}, torch threads {threads}, {args.steps} steps per run (first left "
        f"out of s/step), rounds {args.rounds}, seeds {list(range(args.rounds))}; "
        "median [min-max] over rounds\n"
    )
    print(
        "| side | s/step | generate s | train s | sync ms | tokens/step | peak RSS MB | "
        "bytes per sync | reward, first half -> second half | held-out accuracy |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        half = args.steps // 2
        trend = ", ".join(
            f"{statistics.mean(x['reward'][:half]):.2f} -> {statistics.mean(x['reward'][half:]):.2f}"
            for x in runs
        )
        acc = ", ".join(f"{x['accuracy'][0]:.2f} -> {x['accuracy'][1]:.2f}" for x in runs)
        step = {k: [x["per_step"][k] for x in runs] for k in PER_STEP}
        print(
            f"| {name} | {_span(step['perf/step_s'])} | {_span(step['perf/generate_s'])} | "
            f"{_span(step['perf/train_s'])} | "
            f"{_span([v * 1000 for v in step['perf/sync_s']], '.1f')} | "
            f"{_span([x['tokens'] for x in runs], '.0f')} | "
            f"{_span([x['peak_rss_mb'] for x in runs], '.0f')} | "
            f"{synced[name]['bytes']:,} ({synced[name]['tensors']} tensors) | {trend} | {acc} |"
        )
    train = _ratios(full, lora, lambda x: x["per_step"]["perf/train_s"])
    print(
        f"\nfull / LoRA per round: s/step {', '.join(f'{x:.2f}' for x in speedups)}; train s "
        f"{', '.join(f'{x:.2f}' for x in train)}; peak RSS {', '.join(f'{x:.2f}' for x in rss)}"
    )
    print(f"headline: lora_vs_full_peak_rss_ratio = {statistics.median(rss):.2f}")
    print(
        "headline: lora_vs_full_sync_bytes_ratio = "
        f"{synced['full']['bytes'] / synced['lora']['bytes']:.1f}"
    )
    print(f"headline: lora_vs_full_step_speedup = {statistics.median(speedups):.2f}")


if __name__ == "__main__":
    main()
