"""What a colocate trainer keeps on its device in each phase of a step, with and without
train.offload_between_steps, measured without CUDA (train/offload.resident_bytes: the bytes of
the trainer's parameters, gradients and AdamW state found on its training device).

The CPU default's policy (configs/cpu-default.yaml, float32) on the torch backend, one
micro-batch of 4 rows per step. Each round builds two backends from one seed, trains one with
everything kept and one taking the colocate turns (offload.colocate_turn_bytes), and checks that
both give the same losses and weights, bit for bit. Prints each phase's bytes and the host copy's
size; the headline is what the trainer keeps on its device while the engine generates.

    python bench/offload_phases.py --rounds 3 --steps 4
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's queue (which torch imports).
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import torch  # noqa: E402

VOCAB = 79
"""The CPU default's tokenizer (a character vocabulary of the math task)."""


def _backend(seed: int):
    from relax_core.config import TrainConfig, load_config
    from relax_core.models.tiny import build_tiny_qwen3
    from relax_core.train.torch_backend import build_backend

    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    model = build_tiny_qwen3(cfg.model, vocab_size=VOCAB, seed=seed)
    return build_backend(model, TrainConfig(lr=1e-3), 1.0)


def _micro_batch(seed: int):
    from relax_core.train.batch import make_micro_batch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, VOCAB, (24,), generator=gen).tolist() for _ in range(4)]
    responses = [torch.randint(4, VOCAB, (40 - i,), generator=gen).tolist() for i in range(4)]
    advantages = [[1.0 if i % 2 else -0.5] * len(r) for i, r in enumerate(responses)]
    masks = [[1] * len(r) for r in responses]
    return make_micro_batch(prompts, responses, masks, 0, extras={"advantages": advantages})


def _loss(logprobs, entropy, mb):
    value = -(logprobs * mb.extras["advantages"] * mb.loss_mask).sum() / mb.loss_mask.sum()
    return value, {"loss": value.detach()}


def one_round(seed: int, steps: int) -> dict:
    from relax_core.train.offload import colocate_turn_bytes, resident_bytes

    mb = _micro_batch(seed)
    kept, turning = _backend(seed), _backend(seed)
    kept_losses = [kept.train_step([mb], _loss)["loss"] for _ in range(steps)]
    kept_bytes = resident_bytes(kept.model, kept.optimizer, kept.device)
    losses, phases = [], []
    turning.offload()  # a GPU trainer that gives its device back starts so
    for _ in range(steps):
        train = lambda: losses.append(turning.train_step([mb], _loss)["loss"])  # noqa: E731
        phases.append(colocate_turn_bytes(turning, train))
    host = turning.offloading
    host_bytes = sum(t.nbytes for t in [*host.params.values(), *host.states.values()])
    turning.reload()
    same = losses == kept_losses and all(
        torch.equal(a, b)
        for a, b in zip(kept.model.parameters(), turning.model.parameters(), strict=True)
    )
    return {"kept": kept_bytes, "phases": phases[-1], "host": host_bytes, "same": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    rounds = [one_round(seed, args.steps) for seed in range(args.rounds)]
    first = rounds[0]
    print(f"{'phase':<28}{'params':>12}{'grads':>12}{'optimizer':>12}{'total':>12}")
    rows = [("kept (every phase)", first["kept"])]
    rows += [(f"offloaded: {name}", held) for name, held in first["phases"].items()]
    for name, held in rows:
        values = [held["params"], held["grads"], held["optimizer"]]
        print(f"{name:<28}" + "".join(f"{v:>12,}" for v in values) + f"{sum(values):>12,}")
    print(f"host copy while generating: {first['host']:,} bytes")
    print(
        f"seeds {list(range(args.rounds))}: same losses and weights as kept: "
        f"{[r['same'] for r in rounds]}"
    )
    generating = [sum(r["phases"]["generate"].values()) for r in rounds]
    if not all(r["same"] for r in rounds):
        raise SystemExit("offloading changed the training: losses or weights differ")
    print(f"headline: generate_resident_bytes = {max(generating)}")


if __name__ == "__main__":
    main()
