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

    python -m bench.gpu_check [--size 0.6b|1.7b] [--steps 5] [--parts peak,torch,...]
        [--json results.json]

MFU counts the decoder's matmuls, causal attention and the LM head on scored tokens, x3 for a
training step, against the peak measured here. The last line is
`headline: gpu_check_torch_mfu = X` (the torch backend's MFU; 0 when it did not run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO  # bench/queue.py would shadow the standard library's queue

RESULT = "GPU_CHECK_RESULT "
DEFAULT_PARTS = "peak,torch,fsdp,engine,megatron,nccl"


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
    p.add_argument("--part", default="", help=argparse.SUPPRESS)  # one part, in a child
    p.add_argument("--peak", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--root", default="", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run_part(args: argparse.Namespace) -> None:
    """In a child process: one part, its figures printed as one RESULT line."""
    import torch

    from bench.gpu_parts import ON_GPU, PARTS, Skip

    if ON_GPU and not torch.cuda.is_available():
        out = {"status": "skipped", "why": "no CUDA device visible to torch"}
    else:
        try:
            out = {"status": "ok", **PARTS[args.part](args)}
        except Skip as why:
            out = {"status": "skipped", "why": str(why)}
    print(RESULT + json.dumps(out), flush=True)


def child(name: str, args: argparse.Namespace, peak: float) -> dict:
    argv = [sys.executable, "-m", "bench.gpu_check", "--part", name, "--peak", str(peak)]
    for key in ("size", "steps", "seqs", "micro", "prompt", "response"):
        argv += [f"--{key}", str(getattr(args, key))]
    argv += ["--gen-batch", str(args.gen_batch), "--gen-tokens", str(args.gen_tokens)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-25:]
    return {"status": "failed", "exit_code": proc.returncode, "log_tail": tail}


def show(name: str, result: dict) -> None:
    print(f"\n## {name}: {result['status']}")
    for key, value in result.items():
        if key == "status":
            continue
        if key == "log_tail":
            print("\n".join("    " + line for line in value))
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
    for name in args.parts.split(","):
        results[name] = child(name, args, peak)
        if name == "peak" and results[name]["status"] == "ok":
            peak = results[name]["bf16_peak_tflops"]["median"]
        show(name, results[name])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    failed = [n for n, r in results.items() if r["status"] == "failed"]
    print(f"\nparts failed: {', '.join(failed) or 'none'}")
    torch_mfu = results.get("torch", {}).get("mfu", 0.0)
    print(f"headline: gpu_check_torch_mfu = {torch_mfu:.3f}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
