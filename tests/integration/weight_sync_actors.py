"""Receiver processes for the weight sync tests (run as `python -m tests.integration.weight_sync_actors`).

collect  receive updates and save each taken one as safetensors (`--lazy`: take only after STOP,
         so only the newest version may arrive)

Each writes `ready-r{rank}` into --out once its receiver runs.
engine   a tiny TorchEngine generating greedily in a loop while updates arrive; writes every
         completion with its policy_version plus reference outputs under pure weights A and B,
         and, as it goes, the newest version it generated under to `engine-r{rank}-generated`
         (a test waits on it before sending more)

A receiver that fails (e.g. a layout mismatch at init) prints the error and exits with status 3.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from safetensors.torch import save_file

from relax_core.queue.store import ObjectStore
from relax_core.sync import (
    BroadcastReceiver,
    ObjectStoreReceiver,
    apply_update,
    specs_of,
)

SESSION_TIMEOUT_S = 240.0
"""How long a receiver waits for STOP before it gives up and writes what it took: a bound for
one left behind by its test (which kills it by PID), longer than any test's session on a loaded
machine."""


def layout_tensors(version: int, kind: str = "lm") -> list[tuple[str, torch.Tensor]]:
    """Deterministic weights of `version`: mixed dtypes, one tensor larger than small buckets."""
    gen = torch.Generator().manual_seed(1000 + version)
    f32, bf16 = torch.float32, torch.bfloat16
    shapes = [
        ("embed.weight", (97, 16), f32),
        ("layers.0.attn.q.weight", (16, 16), f32),
        ("layers.0.norm.weight", (16,), bf16),
        ("layers.0.mlp.up.weight", (40, 16), f32),
        ("layers.1.attn.q.weight", (16, 16), bf16),
        ("layers.1.norm.weight", (16,), f32),
        ("layers.1.mlp.up.weight", (41 if kind == "other" else 40, 16), bf16),
        ("lm_head.weight", (97, 16), f32),
    ]
    out = [(n, torch.randn(s, generator=gen).to(dt)) for n, s, dt in shapes]
    out.append(("router.counts", torch.randint(0, 1 << 40, (3,), generator=gen)))
    return out


def tiny_policy(seed: int):
    from relax_core.config import ModelConfig
    from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3

    tok = build_char_tokenizer()
    cfg = ModelConfig(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64
    )
    return build_tiny_qwen3(cfg, len(tok), seed=seed), tok


def engine_prompts(tok) -> list[list[int]]:
    return [tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "40+2=", "7*8=", "x"]]


def _receiver(args: argparse.Namespace, specs):
    store = ObjectStore(args.root, durable=False)
    if args.transport == "broadcast":
        return BroadcastReceiver(
            store,
            args.group,
            f"r{args.rank}",
            specs,
            bucket_bytes=args.bucket_bytes,
            timeout_s=60.0,
        )
    return ObjectStoreReceiver(store, specs, poll_s=0.01)


def _ready(args: argparse.Namespace) -> None:
    _write(os.path.join(args.out, f"ready-r{args.rank}"), "ready")


def _write(path: str, text: str) -> None:
    """Whole or not at all: the test reads it while this process runs."""
    with open(f"{path}.partial", "w") as f:
        f.write(text)
    os.replace(f"{path}.partial", path)


def collect(args: argparse.Namespace) -> None:
    receiver = _receiver(args, specs_of(layout_tensors(0, args.layout)))
    receiver.init()
    receiver.start()
    _ready(args)
    taken = []
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    while time.monotonic() < deadline:
        stopped = receiver.stopped
        update = None if args.lazy and not stopped else receiver.take()
        if update is not None:
            version, tensors = update
            save_file(dict(tensors), os.path.join(args.out, f"r{args.rank}-v{version}.safetensors"))
            taken.append(version)
        elif stopped:
            break
        elif args.lazy:  # an update left pending makes wait() return at once: poll for STOP
            time.sleep(0.05)
        else:
            receiver.wait(0.05)
    assert receiver.take() is None, "a second take() of the same update"
    receiver.destroy()
    with open(os.path.join(args.out, f"r{args.rank}.json"), "w") as f:
        json.dump({"taken": taken, "stopped": receiver.stopped}, f)


def engine(args: argparse.Namespace) -> None:
    from relax_core.rollout.engine import SamplingParams
    from relax_core.rollout.torch_engine import TorchEngine

    model, tok = tiny_policy(seed=0)
    weights_b = list(tiny_policy(seed=1)[0].named_parameters())
    weights_a = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    eng = TorchEngine(model, tok.eos_token_id, tok.pad_token_id)
    prompts, params = engine_prompts(tok), SamplingParams(max_new_tokens=6, greedy=True)

    def outputs() -> list[list]:
        return [[c.response_ids, c.logprobs] for c in eng.generate(prompts, params)]

    eng.update_weights(weights_b, 1)
    refs = {"B": outputs()}
    eng.update_weights(weights_a, 0)
    refs["A"] = outputs()

    receiver = _receiver(args, specs_of(weights_a))
    receiver.init()
    receiver.start()
    _ready(args)
    batches, generated = [], None
    deadline = time.monotonic() + SESSION_TIMEOUT_S
    while time.monotonic() < deadline:
        stopped = receiver.stopped  # read before take(): STOP follows the last update
        update = receiver.take()
        # Generate before applying what was taken, while the receiver stages the next update:
        # a taken update must stay intact until it is applied.
        outs = eng.generate(prompts, params)
        batches.append([[c.policy_version, c.response_ids, c.logprobs] for c in outs])
        if outs[0].policy_version != generated:
            generated = outs[0].policy_version
            _write(os.path.join(args.out, f"engine-r{args.rank}-generated"), str(generated))
        if update is not None:  # staging goes back to the receiver once the engine copied it
            apply_update(eng, update, receiver.release)
        elif stopped:
            break
    receiver.destroy()
    with open(os.path.join(args.out, f"engine-r{args.rank}.json"), "w") as f:
        json.dump({"refs": refs, "batches": batches, "final_version": eng.version}, f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["collect", "engine"])
    parser.add_argument("--transport", choices=["broadcast", "store"], required=True)
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--group", default="rollout")
    parser.add_argument("--rank", type=int, default=1)
    parser.add_argument("--bucket-bytes", type=int, default=1024)
    parser.add_argument("--layout", default="lm")
    parser.add_argument("--lazy", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        collect(args) if args.mode == "collect" else engine(args)
    except Exception as err:
        print(f"receiver failed: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        sys.exit(3)


if __name__ == "__main__":
    main()
