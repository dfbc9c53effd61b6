"""bench/vs_trl.py's statistics and report: per-run summaries, medians over rounds, the table,
the per-phase profiles and the `headline:` lines."""

from __future__ import annotations

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
    reach = result["time_to_target"]
    print(
        f"[{kind:>5} {task} seed {result['seed']}] {result['s_per_step']:.3f} s/step, "
        f"{result['tokens_per_step']:.0f} tokens/step, {result['tokens_per_s']:.0f} tokens/s, "
        f"to {TASKS[task].target:.2f}: {'-' if reach is None else f'{reach:.1f} s'}, evals "
        f"{curve}, load average {result['load']:.1f}",
        flush=True,
    )


def median_of(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return statistics.median(values) if values else None


def spread(values: list[float], digits: int = 2) -> str:
    """median (min-max)"""
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(statistics.median(values))} ({f.format(min(values))}-{f.format(max(values))})"
    )


def print_report(results: dict[str, dict[str, list[dict]]], args, cpus: list[int]) -> None:
    """The table (medians over runs), per-pair speedups and per-seed times to the target, the
    profiles, then the headline lines."""
    print(
        f"\nCPUs {cpus}, {args.threads} torch threads per process; seeds {args.seeds}; "
        f"{args.rounds} round(s) per seed; warm-up steps left out per task: "
        + ", ".join(
            f"{t} {TASKS[t].warmup if args.warmup is None else args.warmup}" for t in results
        )
    )
    print(
        f"{'task':<8} {'run':<14} {'s/step':>8} {'tokens/step':>12} {'tokens/s':>9} "
        f"{'target':>7} {'time to target':>15}"
    )
    headlines = []
    for task, by_kind in results.items():
        for kind, runs in by_kind.items():
            reach = median_of(runs, "time_to_target")
            reached = sum(r["time_to_target"] is not None for r in runs)
            reach_text = f"{reach:.1f} s ({reached}/{len(runs)})" if reach else f"- (0/{len(runs)})"
            print(
                f"{task:<8} {LABELS[kind]:<14} {median_of(runs, 's_per_step'):>8.3f} "
                f"{median_of(runs, 'tokens_per_step'):>12.0f} "
                f"{median_of(runs, 'tokens_per_s'):>9.0f} {TASKS[task].target:>7.2f} "
                f"{reach_text:>15}"
            )
        trl = by_kind["trl"]
        for kind in [k for k in by_kind if k != "trl"]:
            ratios = [
                t["s_per_step"] / o["s_per_step"] for o, t in zip(by_kind[kind], trl, strict=True)
            ]
            name = f"speedup_{task}" + ("" if kind == "ours" else f"_{kind}")
            print(f"{name}: TRL s/step / {LABELS[kind]} s/step per pair: "
                  f"{' '.join(f'{r:.2f}' for r in ratios)}; median (min-max) {spread(ratios)}")  # fmt: skip
            headlines.append(f"headline: {name} = {statistics.median(ratios):.2f}")
        ours = by_kind["ours"]
        times = [
            (o["seed"], o["time_to_target"], t["time_to_target"])
            for o, t in zip(ours, trl, strict=True)
        ]
        print(f"time to {TASKS[task].target:.2f} held-out, ours colocate vs TRL (summed step s): "
              + ", ".join(f"seed {s}: {_s(a)} vs {_s(b)}" for s, a, b in times))  # fmt: skip
        both = [b / a for _, a, b in times if a is not None and b is not None]
        if both:
            headlines.append(f"headline: time_to_acc_{task} = {statistics.median(both):.2f}")
            print(f"time_to_acc_{task}: TRL / ours over {len(both)} of {len(times)} seeds where "
                  f"both reached it: median (min-max) {spread(both)}")  # fmt: skip
        else:
            print(f"time_to_acc_{task}: no seed where both reached {TASKS[task].target:.2f}")
    for task, by_kind in results.items():
        for kind in ("ours", "trl"):
            print_profile(task, kind, by_kind[kind])
    print()
    print("\n".join(headlines))


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f} s"


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
