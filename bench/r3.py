"""Cost of rollout routing replay (R3) on a tiny Qwen3-MoE policy on CPU, side by side.

One process pinned to `--cpus` with `--threads` torch threads (one by default), the same weights
and prompts for both sides, repeats alternating between them (so drift in machine load hits both
alike); each repeat is an A/B pair. The median of each side is reported:
- generate: the torch engine sampling a batch, plain vs recording each token's experts;
- train: queue rows (Arrow) -> micro-batches -> one optimizer step, plain vs carrying the
  recorded experts and replaying them in the forward;
- step: generate + train.

    python bench/r3.py [--repeats 15] [--prompts 64] [--new-tokens 32] [--cpus 0] [--threads 1]

Prints the R3/plain step ratio per pair as median (min-max), and last `headline: r3_overhead =
X`, that median.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue`: put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import copy
import statistics
import time

import torch

from bench.common import add_pin_args, cpu_set, median_range
from relax_core.config import ModelConfig
from relax_core.models.routing_replay import attach_routing_replay
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.queue import rows_to_table
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batching import table_micro_batches
from relax_core.train.torch_backend import TorchBackend

MODEL = ModelConfig(
    hidden_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    num_experts=8,
    experts_per_token=2,
)


def _loss(logprobs, entropy, mb):
    return -(logprobs * mb.loss_mask).sum() / mb.loss_mask.sum().clamp(min=1), {}


class Side:
    """One arm of the comparison: an engine and a trainer on their own copies of the policy."""

    def __init__(self, policy, tok, r3: bool) -> None:
        self.r3 = r3
        engine_model, train_model = copy.deepcopy(policy), copy.deepcopy(policy)
        if r3:
            attach_routing_replay(engine_model)
            attach_routing_replay(train_model)
        self.engine = TorchEngine(engine_model, tok.eos_token_id, tok.pad_token_id, seed=0)
        self.backend = TorchBackend(train_model, lr=1e-6)
        self.pad = tok.pad_token_id

    def generate(self, prompts, params):
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, params)
        return time.perf_counter() - t0, outs

    def train(self, prompts, outs) -> float:
        rows = [
            {
                "uid": f"r{i}",
                "group_id": f"g{i // 4}",
                "prompt_ids": p,
                "response_ids": c.response_ids,
                "loss_mask": [1] * len(c.response_ids),
                "routed_experts": c.routed_experts,
            }
            for i, (p, c) in enumerate(zip(prompts, outs, strict=True))
        ]
        table = rows_to_table(rows)
        t0 = time.perf_counter()
        mbs = [mb for _, mb in table_micro_batches(table, self.pad, 4096, routed_experts=self.r3)]
        self.backend.train_step(mbs, _loss)
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=32)
    add_pin_args(p, threads=1)
    a = p.parse_args()
    cpus = cpu_set(a.cpus)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(a.threads)
    tok = build_char_tokenizer()
    policy = build_tiny_qwen3(MODEL, len(tok), seed=0)
    texts = [f"{i}+{3 * i + 7}=" for i in range(a.prompts)]
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    # Same weights, same seed and capture changes no output: both sides sample the same tokens.
    params = SamplingParams(max_new_tokens=a.new_tokens, temperature=1.0)
    sides = {"plain": Side(policy, tok, r3=False), "r3": Side(policy, tok, r3=True)}
    for side in sides.values():  # warm-up: allocator, kernels
        _, outs = side.generate(prompts, params)
        side.train(prompts, outs)
    times: dict[str, dict[str, list[float]]] = {k: {"gen": [], "train": []} for k in sides}
    tokens = {k: 0 for k in sides}
    for rep in range(a.repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        for name in order:
            gen_s, outs = sides[name].generate(prompts, params)
            times[name]["gen"].append(gen_s)
            times[name]["train"].append(sides[name].train(prompts, outs))
            tokens[name] += sum(len(c.response_ids) for c in outs)
    med = {k: {part: statistics.median(v) for part, v in t.items()} for k, t in times.items()}
    for m in med.values():
        m["step"] = m["gen"] + m["train"]
    print(
        f"tiny Qwen3-MoE: hidden {MODEL.hidden_size}, {MODEL.num_layers} layers, "
        f"{MODEL.num_experts} experts top-{MODEL.experts_per_token}; {a.prompts} prompts x "
        f"{a.new_tokens} new tokens; CPUs {cpus}, {a.threads} torch threads; median of "
        f"{a.repeats} alternating repeats"
    )
    print(f"{'phase':<10} {'plain s':>10} {'r3 s':>10} {'r3/plain':>10}")
    for part in ("gen", "train", "step"):
        plain, r3 = med["plain"][part], med["r3"][part]
        print(f"{part:<10} {plain:>10.4f} {r3:>10.4f} {r3 / plain:>10.3f}")
    print(f"generated tokens per side: plain {tokens['plain']}, r3 {tokens['r3']}")
    pairs = [
        (g3 + t3) / (g0 + t0)
        for g3, t3, g0, t0 in zip(
            times["r3"]["gen"],
            times["r3"]["train"],
            times["plain"]["gen"],
            times["plain"]["train"],
            strict=True,
        )
    ]
    print(f"r3/plain step per pair: median (min-max) {median_range(pairs)}")
    print(f"headline: r3_overhead = {statistics.median(pairs):.3f}")


if __name__ == "__main__":
    main()
