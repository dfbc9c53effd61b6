"""Calculator-env prompts ("What is 347*58?\n" -> "20126"): a 3-digit times a 2-digit number, for
the agentic run (`env.name: calculator`), the policy answering with the help of a calc() tool.

The rows come from `relax_core.envs.calculator.generate(seed)`: distinct questions, train and eval
disjoint. Deterministic: the same seed writes byte-identical files.

    python datasets/calculator.py --out datasets/calculator
"""

from __future__ import annotations

import argparse
import os

from relax_core.data.dataset import write_prompts
from relax_core.envs.calculator import generate

DEFAULT_SEED = 0
TRAIN_SIZE = 2000
EVAL_SIZE = 128


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="picks the questions")
    args = parser.parse_args(argv)
    train, eval_ = generate(args.seed, TRAIN_SIZE, EVAL_SIZE)
    write_prompts(train, os.path.join(args.out, "train.jsonl"))
    write_prompts(eval_, os.path.join(args.out, "eval.jsonl"))
    print(f"wrote {len(train)} train and {len(eval_)} eval rows to {args.out}")


if __name__ == "__main__":
    main()
