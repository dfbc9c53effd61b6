"""GPU bring-up kit: does the GPU path train, generate and sync on this machine, and how fast.

For a bare GPU machine whose Python has CUDA torch and transformers but maybe nothing else of
ours (no SGLang, no megatron-core, no network): scripts/gpu_check.sh installs what travels with
it as wheels (.whl/) and runs this. Each part runs in its own process, so one that breaks does
not hide the others:

  peak      the card's measured bf16 matmul peak (the MFU denominator)
  torch     torch backend, Qwen3 shape (random weights), bf16 compute on float32 master
            weights: step time, tokens/s, MFU, and the share of bf16 weights a 1e-6 step moved
  fsdp      the same through the FSDP2 backend (one rank, nccl)
  engine    torch rollout engine generation on the GPU: decode tokens/s
  megatron  Megatron-core from the HF policy: log-prob gap to HF, HF names round trip, step
  nccl      our NCCL weight broadcast between two GPUs (skipped on one)
  plan      the memory plan against measured peaks, Qwen3-4B shape, micro-batches of 2k, 4k and
            16k tokens, activation checkpointing off and on (bench/gpu_check_plan.py)
  sglang_ipc  the colocate hand-off to SGLang by CUDA IPC handles (bench/gpu_check_ipc.py)

    python -m bench.gpu_check [--size 0.6b|1.7b] [--steps 5] [--parts peak,torch,...]
        [--json results.json] [--bounds plan=90,torch=60]

Every part has a bound (BOUNDS, seconds; --bounds changes some): a part past it is killed with
its process group and recorded as `timed_out`, with the figures it had reported so far. The
defaults sum to 220 s, so the default run fits a short GPU loan. --json is rewritten (whole,
atomically) after every part: a run killed from outside keeps the parts it finished.

MFU counts the decoder's matmuls, causal attention and the LM head on scored tokens, x3 for a
training step, against the peak measured here. The last line is
`headline: gpu_check_torch_mfu = X` (the torch backend's MFU; 0 when it did not run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO  # bench/queue.py would shadow the standard library's queue

RESULT = "GPU_CHECK_RESULT "
PARTIAL = "GPU_CHECK_PARTIAL "
"""A line a part prints with its figures so far; the last one is kept if the part times out."""
BOUNDS = {
    "peak": 15,
    "torch": 30,
    "fsdp": 30,
    "engine": 30,
    "megatron": 30,
    "nccl": 15,
    "plan": 45,
    "sglang_ipc": 25,
}
"""Seconds each part may take by default, its imports and CUDA start included (an H200 took
about half of each in the runs of bench/RESULTS.md)."""
DEFAULT_PARTS = ",".join(BOUNDS)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["0.6b", "1.7b", "tiny"], default="0.6b")
    p.add_argument("--steps", type=int, default=5, help="timed training steps (after 1 warm-up)")
    p.add_argument("--seqs", type=int, default=16, help="sequences per training step")
    p.add_argument("--micro", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens per sequence")
    p.add_argument("--response", type=int, default=768, help="response tokens per sequence")
    p.add_argument("--gen-batch", type=int, default=64, help="prompts per generate call")
    p.add_argument("--gen-tokens", type=int, default=256, help="new tokens per prompt")
    p.add_argument("--parts", default=DEFAULT_PARTS)
    p.add_argument("--json", default="", help="also write every part's figures here")
    p.add_argument("--bounds", default="", help="part=seconds,... over the default bounds")
    p.add_argument("--plan-size", choices=["4b", "tiny"], default="4b")
    p.add_argument("--plan-tokens", default="2048,4096,16384", help="micro-batch tokens, plan")
    p.add_argument("--part", default="", help=argparse.SUPPRESS)  # one part, in a child
    p.add_argument("--peak", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    p.add_argument("--ipc-timeout", type=float, default=20.0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_part(args: argparse.Namespace) -> None:
    """In a child process: one part, its figures printed as one RESULT line."""
    import torch

    from bench.gpu_check_ipc import part_sglang_ipc
    from bench.gpu_check_plan import part_plan
    from bench.gpu_parts import ON_GPU, PARTS, Skip

    parts = {**PARTS, "plan": part_plan, "sglang_ipc": part_sglang_ipc}
    args.progress = lambda figures: print(PARTIAL + json.dumps(figures), flush=True)
    if ON_GPU and not torch.cuda.is_available():
        out = {"status": "skipped", "why": "no CUDA device visible to torch"}
    else:
        try:
            out = {"status": "ok", **parts[args.part](args)}
        except Skip as why:
            out = {"status": "skipped", "why": str(why)}
    print(RESULT + json.dumps(out), flush=True)


def bounds(args: argparse.Namespace) -> dict[str, float]:
    """Each part's bound in seconds: the defaults, with --bounds over them."""
    out: dict[str, float] = dict(BOUNDS)
    for item in filter(None, args.bounds.split(",")):
        name, _, seconds = item.partition("=")
        if name not in BOUNDS or not seconds:
            raise SystemExit(
                f"--bounds {item!r}: expected part=seconds, part one of {DEFAULT_PARTS}"
            )
        out[name] = float(seconds)
    return out


def _last(lines: list[str], prefix: str) -> dict | None:
    found = [line[len(prefix) :] for line in lines if line.startswith(prefix)]
    return json.loads(found[-1]) if found else None


def child(name: str, args: argparse.Namespace, peak: float, bound: float) -> dict:
    """Part `name` in its own process group, killed with it past `bound` seconds."""
    argv = [sys.executable, "-m", "bench.gpu_check", "--part", name, "--peak", str(peak)]
    for key in ("size", "steps", "seqs", "micro", "prompt", "response", "plan_size"):
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    argv += ["--gen-batch", str(args.gen_batch), "--gen-tokens", str(args.gen_tokens)]
    argv += ["--plan-tokens", args.plan_tokens, "--ipc-timeout", str(max(1.0, bound - 5))]
    proc = subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        partial = _last(stdout.splitlines(), PARTIAL) or {}
        return {"status": "timed_out", "bound_s": bound, **partial}
    result = _last(stdout.splitlines(), RESULT)
    if result is not None:
        return result
    tail = (stdout + stderr).strip().splitlines()[-25:]
    return {"status": "failed", "exit_code": proc.returncode, "log_tail": tail}


def write_json(path: str, args: argparse.Namespace, results: dict, limits: dict) -> None:
    """The figures so far, replacing the file whole (a reader never sees half of it)."""
    body = {"args": vars(args), "bounds_s": limits, "results": results}
    with open(path + ".tmp", "w") as f:
        json.dump(body, f, indent=2)
    os.replace(path + ".tmp", path)


def show(name: str, result: dict) -> None:
    print(f"\n## {name}: {result['status']}")
    for key, value in result.items():
        if key == "status":
            continue
        if key == "log_tail":
            print("\n".join("    " + line for line in value))
        elif isinstance(value, list):
            print(f"  {key}:" + "".join(f"\n    {json.dumps(item)}" for item in value))
        elif isinstance(value, dict) and "median" in value:
            print(
                f"  {key}: median {value['median']:.4g} (min {value['min']:.4g}, "
                f"max {value['max']:.4g})"
            )
        elif isinstance(value, float):
            print(f"  {key}: {value:.4g}")
        else:
            print(f"  {key}: {value}")


def main() -> None:
    args = parse()
    if args.part:
        run_part(args)
        return
    results: dict[str, dict] = {}
    peak = 0.0
    limits = bounds(args)
    for name in args.parts.split(","):
        if name not in limits:
            raise SystemExit(f"--parts: {name!r} is not a part ({DEFAULT_PARTS})")
        results[name] = child(name, args, peak, limits[name])
        if name == "peak" and results[name]["status"] == "ok":
            peak = results[name]["bf16_peak_tflops"]["median"]
        show(name, results[name])
        if args.json:
            write_json(args.json, args, results, limits)
    failed = [n for n, r in results.items() if r["status"] in ("failed", "timed_out")]
    print(f"\nparts failed: {', '.join(failed) or 'none'}")
    torch_mfu = results.get("torch", {}).get("mfu", 0.0)
    print(f"headline: gpu_check_torch_mfu = {torch_mfu:.3f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
