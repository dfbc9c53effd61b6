"""GSM-style word problems generated offline with reasoning_gym's "gsm_symbolic" templates.

One reasoning_gym dataset of candidates is drawn from ``seed``; the first ``n_eval`` usable
problems become the eval split, the next ``n_train`` the train split. Problems are kept only
once (by question text), so the splits are disjoint. Problems whose answer is negative are
dropped: the templates produce them only as nonsense such as an age of -1.

    python datasets/gsm.py --out datasets/gsm
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from relax_core.data.dataset import write_prompts

DEFAULT_SEED = 0
DEFAULT_TRAIN = 2000
DEFAULT_EVAL = 128
SOURCE = "reasoning_gym/gsm_symbolic"
# reasoning_gym appends this to every question; our own instruction replaces it.
_RG_SUFFIX = " Give the result as your final answer. Do not include units."
INSTRUCTION = (
    "Solve the problem step by step. End your response with a final line of the form "
    '"Answer: <number>", giving only the number, without units.'
)


def _candidates(seed: int, size: int) -> Iterator[dict]:
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("datasets/gsm.py needs the package reasoning-gym==0.1.25") from None
    source = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=size)
    for idx in range(size):
        entry = source[idx]
        question = entry["question"].removesuffix(_RG_SUFFIX).strip()
        yield {
            "prompt": f"{question}\n\n{INSTRUCTION}",
            "answer": str(entry["answer"]),
            "meta": {"source": SOURCE, "seed": seed, "source_index": idx},
        }


def generate(
    seed: int = DEFAULT_SEED, n_train: int = DEFAULT_TRAIN, n_eval: int = DEFAULT_EVAL
) -> tuple[list[dict], list[dict]]:
    """Return ``(train_rows, eval_rows)`` of sizes ``n_train`` and ``n_eval``, disjoint."""
    if n_train <= 0 or n_eval <= 0:
        raise ValueError(f"n_train and n_eval must be > 0, got {n_train} and {n_eval}")
    wanted = n_train + n_eval
    # Head-room for dropped duplicates and negative answers (about 1% each in practice).
    size = wanted + wanted // 10 + 16
    kept: list[dict] = []
    seen: set[str] = set()
    for row in _candidates(seed, size):
        if row["prompt"] in seen or float(row["answer"]) < 0:
            continue
        seen.add(row["prompt"])
        kept.append(row)
        if len(kept) == wanted:
            return kept[n_eval:], kept[:n_eval]
    raise RuntimeError(
        f"only {len(kept)} distinct usable problems among {size} candidates; wanted {wanted}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--train", type=int, default=DEFAULT_TRAIN, help="train rows")
    parser.add_argument("--eval", type=int, default=DEFAULT_EVAL, help="eval rows")
    args = parser.parse_args(argv)
    train, eval_ = generate(args.seed, args.train, args.eval)
    write_prompts(train, os.path.join(args.out, "train.jsonl"))
    write_prompts(eval_, os.path.join(args.out, "eval.jsonl"))
    print(f"wrote {len(train)} train and {len(eval_)} eval rows to {args.out}")


if __name__ == "__main__":
    main()
