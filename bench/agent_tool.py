"""SmolLM2-135M-Instruct learning the calculator tool on CPU: the learning curve of
`configs/smollm2-135m-tool-cpu.yaml` over several seeds, one run after another.

Each seed runs the config as it is (warm start on the env's demonstrations, then multi-turn GRPO,
colocate) as one child `python -m relax_core.entrypoints.run --cfg <cfg>`, in a fresh work
directory with its own MLflow store. This process pins itself to `--cpus` before starting
anything, so every run has the same CPU set and the config's torch thread count. Each seed's
warm-started policy is prepared (and cached) before its run starts, and timed apart from it.

Read back from each run's MLflow store: held-out greedy success, tool-call validity and tool
calls per episode at every eval (`eval/success_rate`, `eval/tool_call_validity`,
`eval/tool_calls`), the same of the sampled rollouts per step (`rollout/...`, averaged over bands
of `--band` steps), seconds per step (`perf/step_s`, the first step left out as warm-up) and the
run's wall time. Tool-call validity is valid calls / calls, so it is absent ("-") where no
episode called the tool.

    python bench/agent_tool.py [--seeds 0,1,2] [--cpus 0,1] [--band 3] [--keep DIR] [--config C]

`--config configs/smollm2-135m-langchain-cpu.yaml` runs the same task played by a LangChain
agent through the OpenAI-compatible endpoint (Hermes tool calls, warm start on the agent's own
demonstrations) instead of the env loop.

Last line: `headline: smollm2_tool_success_gain = X` (the LangChain config:
`smollm2_langchain_success_gain`), the mean over seeds of final minus initial held-out success.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import statistics
import tempfile
import time

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

from bench.common import (
    prepared_policy,
    repo_data,
    start_local_run,
    work_sections,
    write_config,
)

CONFIG = os.path.join(REPO, "configs", "smollm2-135m-tool-cpu.yaml")
HEADLINES = {
    "smollm2-135m-tool-cpu": "smollm2_tool_success_gain",
    "smollm2-135m-langchain-cpu": "smollm2_langchain_success_gain",
}
EVAL = ("eval/success_rate", "eval/tool_call_validity", "eval/tool_calls")
PER_STEP = (
    "rollout/success_rate",
    "rollout/tool_call_validity",
    "rollout/tool_calls",
    "perf/step_s",
    "perf/generate_s",
    "perf/train_s",
)


def _config(work: str, seed: int, config: str = CONFIG):
    from relax_core.config import load_config, replace

    cfg = load_config(config)
    return replace(
        cfg, seed=seed, **work_sections(work, experiment="bench-agent-tool"), **repo_data(cfg)
    )


def _history(client, run_id: str, key: str) -> dict[int, float]:
    """{step: value} of one metric (absent steps: the metric was not logged there, e.g. tool-call
    validity on a step without any tool call)."""
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def _metrics(cfg) -> dict[str, dict[int, float]]:
    import mlflow

    client = mlflow.tracking.MlflowClient(cfg.tracking.tracking_uri)
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    (run,) = client.search_runs([exp.experiment_id])
    return {key: _history(client, run.info.run_id, key) for key in EVAL + PER_STEP}


def run_seed(work: str, seed: int, config: str = CONFIG) -> dict:
    cfg = _config(work, seed, config)
    t0 = time.perf_counter()
    prepared_policy(cfg)  # the warm start, keyed on the seed; cached for the run to find
    prepare_s = time.perf_counter() - t0
    cfg_path = write_config(cfg, os.path.join(work, "run.json"))
    log_path = os.path.join(work, "run.log")
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = start_local_run(cfg_path, log_path)
    if proc.wait():
        with open(log_path) as f:
            raise SystemExit(f"seed {seed} run failed ({proc.returncode}):\n{f.read()[-4000:]}")
    wall = time.perf_counter() - t0
    return {
        "seed": seed,
        "metrics": _metrics(cfg),
        "prepare_s": prepare_s,
        "wall_s": wall,
        "load": (load0, os.getloadavg()[0]),
        "steps": cfg.train.total_steps,
    }


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else f"{value:{spec}}"


def _span(values: list[float], spec: str = ".1f") -> str:
    return f"{statistics.median(values):{spec}} [{min(values):{spec}}-{max(values):{spec}}]"


def _band_mean(series: dict[int, float], lo: int, hi: int) -> float | None:
    values = [v for step, v in series.items() if lo <= step <= hi]
    return statistics.mean(values) if values else None


def _report_seed(res: dict, band: int) -> None:
    m = res["metrics"]
    print(
        f"\n[seed {res['seed']}] warm start + conversion {res['prepare_s']:.0f} s (cached when "
        f"0), run wall {res['wall_s']:.0f} s, load {res['load'][0]:.1f}->{res['load'][1]:.1f}"
    )
    evals = sorted(m["eval/success_rate"])
    print("| held-out (greedy) | " + " | ".join(f"step {s}" for s in evals) + " |")
    print("| --- |" + " --- |" * len(evals))
    for key, name in ((EVAL[0], "success"), (EVAL[1], "tool-call validity"), (EVAL[2], "calls")):
        print(f"| {name} | " + " | ".join(_fmt(m[key].get(s)) for s in evals) + " |")
    bands = [(lo, min(lo + band - 1, res["steps"])) for lo in range(1, res["steps"] + 1, band)]
    print("| rollout (sampled) | " + " | ".join(f"{lo}-{hi}" for lo, hi in bands) + " |")
    print("| --- |" + " --- |" * len(bands))
    rollout = zip(PER_STEP[:3], ("success", "tool-call validity", "calls"), strict=True)
    for key, name in rollout:
        row = [_fmt(_band_mean(m[key], lo, hi)) for lo, hi in bands]
        print(f"| {name} | " + " | ".join(row) + " |")
    steps = [v for s, v in sorted(m["perf/step_s"].items()) if s > 1]
    if steps:
        gen = [v for s, v in m["perf/generate_s"].items() if s > 1]
        train = [v for s, v in m["perf/train_s"].items() if s > 1]
        print(
            f"s/step {_span(steps)} (generate {_span(gen)}, train {_span(train)}), steps 2-"
            f"{res['steps']}"
        )


def _summary(args, results: list[dict]) -> None:
    print(f"\ncpus {args.cpus}, seeds {[r['seed'] for r in results]}, config {args.config}")
    print("| seed | held-out success | held-out tool-call validity | s/step | run wall s |")
    print("| --- | --- | --- | --- | --- |")
    gains, all_steps = [], []
    for res in results:
        m = res["metrics"]
        success = [v for _, v in sorted(m["eval/success_rate"].items())]
        validity = m["eval/tool_call_validity"]
        first, last = min(m["eval/success_rate"]), max(m["eval/success_rate"])
        gains.append(success[-1] - success[0])
        steps = [v for s, v in m["perf/step_s"].items() if s > 1]
        all_steps += steps
        print(
            f"| {res['seed']} | {success[0]:.2f} -> {success[-1]:.2f} | "
            f"{_fmt(validity.get(first))} -> {_fmt(validity.get(last))} | "
            f"{_span(steps) if steps else '-'} | {res['wall_s']:.0f} |"
        )
    if all_steps:
        print(f"\ns/step over all seeds and steps 2+: {_span(all_steps)}")
    walls = [r["wall_s"] for r in results]
    print(f"run wall: {_span(walls, '.0f')} s (warm start timed apart, see each seed)")
    print(f"success gain per seed: {', '.join(f'{g:+.2f}' for g in gains)}")
    name = os.path.basename(args.config).removesuffix(".yaml")
    headline = HEADLINES.get(name, name.replace("-", "_") + "_success_gain")
    print(f"headline: {headline} = {statistics.mean(gains):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="one run per seed, in this order")
    parser.add_argument("--cpus", default="0,1", help="CPU set every process runs on")
    parser.add_argument("--band", type=int, default=3, help="steps per rollout band")
    parser.add_argument("--keep", help="keep run directories under this path (default: temp)")
    parser.add_argument("--config", default=CONFIG, help="the run config (default: %(default)s)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})  # inherited by every run
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        prefix = f"bench-agent-tool-{seed}-"
        if args.keep:  # the run directory (MLflow store, checkpoints, queue) stays for a look
            results.append(
                run_seed(tempfile.mkdtemp(prefix=prefix, dir=args.keep), seed, args.config)
            )
        else:
            with tempfile.TemporaryDirectory(prefix=prefix) as work:
                results.append(run_seed(work, seed, args.config))
        _report_seed(results[-1], args.band)
    _summary(args, results)


if __name__ == "__main__":
    main()
