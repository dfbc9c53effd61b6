"""bench/vs_trl.py's statistics and report: per-run summaries, medians over rounds, the table,
the per-phase profiles and the `headline:` lines."""

from __future__ import annotations

import os
import statistics

from bench.vs_trl_tasks import TASKS

LABELS = {"ours": "ours colocate", "async": "ours async", "trl": "TRL"}


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


def print_run(kind: str, task: str, result: dict) -> None:
    """One line per finished run, as it finishes."""
    curve = " ".join(f"{s}:{a:.2f}" for s, a in result["evals"])
    print(
        f"[{kind:>5} {task}] {result['s_per_step']:.3f} s/step, {result['tokens_per_step']:.0f} "
        f"tokens/step, {result['tokens_per_s']:.0f} tokens/s, evals {curve}, process "
        f"{result['wall_s']:.0f} s, load average {result['load'][0]:.1f} -> {result['load'][1]:.1f}",
        flush=True,
    )


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
            reach_text = f"{reach:.1f} s ({reached}/{len(runs)})" if reach else f"- (0/{len(runs)})"
            print(
                f"{task:<8} {LABELS[kind]:<14} {s:>8.3f} "
                f"{median_of(runs, 'tokens_per_step'):>12.0f} "
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
