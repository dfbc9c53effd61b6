"""Guess-the-number prompts ("Guess my number from 1 to 16.\n" -> the hidden number) for the
agentic run with `env.name: guess_number`: train targets drawn with the seed, eval cycling
through every number in order.

The rows come from `relax_core.envs.guess_number.generate(seed)`. Deterministic: the same seed
writes byte-identical files.

    python datasets/guess_number.py --out datasets/guess_number
"""

from __future__ import annotations

import argparse
import os

from relax_core.data.dataset import write_prompts
from relax_core.envs.guess_number import DEFAULT_HIGH, generate

DEFAULT_SEED = 0
TRAIN_SIZE = 1024
EVAL_SIZE = 64


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="picks the train targets")
    parser.add_argument("--high", type=int, default=DEFAULT_HIGH, help="numbers are 1..high")
    args = parser.parse_args(argv)
    train, eval_ = generate(args.seed, args.high, TRAIN_SIZE, EVAL_SIZE)
    write_prompts(train, os.path.join(args.out, "train.jsonl"))
    write_prompts(eval_, os.path.join(args.out, "eval.jsonl"))
    print(f"wrote {len(train)} train and {len(eval_)} eval rows to {args.out}")


if __name__ == "__main__":
    main()
