"""One-digit addition questions in words ("What is 6 + 9?"), for small pretrained chat models.

SmolLM2-135M-Instruct answers about 40% of these correctly in 32 new tokens (measured here), a
task it partly solves, which is what RL needs. All 100 pairs 0 <= a, b <= 9: 20 drawn with the
seed are held out for eval, the other 80 train. Deterministic.

    python datasets/sums_words.py --out datasets/sums_words
"""

from __future__ import annotations

import argparse
import os
import random

from relax_core.data.dataset import write_prompts

EVAL_SIZE = 20


def _row(a: int, b: int) -> dict:
    prompt = f"What is {a} + {b}? Finish with a line 'Answer: <number>'."
    return {"prompt": prompt, "answer": str(a + b)}


def generate(seed: int = 0) -> tuple[list[dict], list[dict]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    held_out = set(random.Random(seed).sample(pairs, EVAL_SIZE))
    train = [_row(a, b) for a, b in pairs if (a, b) not in held_out]
    return train, [_row(a, b) for a, b in sorted(held_out)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "sums_words"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name, rows in zip(("train", "eval"), generate(args.seed), strict=True):
        write_prompts(rows, os.path.join(args.out, f"{name}.jsonl"))
    print(f"wrote sums_words to {args.out}")


if __name__ == "__main__":
    main()
