"""Engine overhead: the colocate controller's step vs a bare PyTorch loop doing the same math.

Both start from the same warm-started tiny policy and do, per step: sample 32 prompts x 8 responses
(4 new tokens, KV cache), score them, group-normalize rewards, one GRPO (PPO-clip) step with AdamW.
The engine additionally writes/reads the TransferQueue (Arrow IPC, fsync), validates schemas,
copies weights to its rollout engine and keeps its metrics. Runs alternate A B A B.

    python bench/overhead.py [--steps 30] [--rounds 3]

Last line: `headline: engine_overhead = X` (engine seconds per step / bare seconds per step).
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run as a script, bench/ leads sys.path, where bench/queue.py would shadow the standard
# library's `queue` (imported by torch, s3fs and concurrent.futures): put the repo there instead.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse
import copy
import statistics
import tempfile
import time

import torch
from transformers import DynamicCache

from bench.common import prepared_policy
from relax_core.config import load_config, replace
from relax_core.data.dataset import load_prompts
from relax_core.models.policy import load_policy
from relax_core.run.colocate import ColocateController
from relax_core.run.session import RunSession
from relax_core.train.run_state import RunState


class BareLoop:
    """~60 lines of plain PyTorch: the least a GRPO step on this model has to do."""

    def __init__(self, model, tokenizer, rows, seed: int) -> None:
        self.model, self.tok, self.rows = model, tokenizer, rows
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
        self.gen = torch.Generator().manual_seed(seed)
        self.ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
        self.i = 0

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, new: int):
        self.model.eval()
        cache, ids, out = DynamicCache(), prompts, []
        for _ in range(new):
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
            ids = torch.multinomial(torch.softmax(logits, -1), 1, generator=self.gen)
            out.append(ids)
        return torch.cat(out, 1)

    def step(self, groups: int = 32, n: int = 8, new: int = 4) -> None:
        picks = [(self.i + k) % len(self.rows) for k in range(groups)]
        self.i += groups
        # Fixed-width prompts (00+00=) so no padding is needed: the bare loop's best case.
        prompts = torch.tensor([self.ids[p] for p in picks]).repeat_interleave(n, 0)
        resp = self.sample(prompts, new)
        eos = self.tok.eos_token_id
        ends = (resp == eos).int().cumsum(1)
        mask = ((ends == 0) | ((ends == 1) & (resp == eos))).float()
        texts = self.tok.batch_decode(resp * mask.long(), skip_special_tokens=True)
        answers = [self.rows[p]["answer"] for p in picks for _ in range(n)]
        r = torch.tensor([float(t.strip() == a) for t, a in zip(texts, answers, strict=True)])
        g = r.view(groups, n)
        adv = (g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + 1e-6)
        adv = adv.reshape(-1, 1)
        self.model.train()
        seq = torch.cat([prompts, resp], 1)
        logits = self.model(input_ids=seq).logits[:, prompts.shape[1] - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.28))
        loss = (pg * mask).sum() / mask.sum()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()


def timed(fn, steps: int) -> float:
    fn()  # warm-up step, not timed
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.chdir(REPO)
    work = tempfile.mkdtemp(prefix="relax-bench-")
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    cfg = replace(
        cfg,
        queue={"root": os.path.join(work, "queue")},
        checkpoint={"dir": os.path.join(work, "ckpt")},
        train={"total_steps": 10_000},
    )
    policy = prepared_policy(cfg)
    session = RunSession(cfg, policy, RunState(run_id="bench-overhead"))
    engine = ColocateController(session)
    model, tok = load_policy(policy)
    bare = BareLoop(copy.deepcopy(model), tok, load_prompts(cfg.data.train_path), cfg.seed)

    eng_s, bare_s = [], []
    for _ in range(args.rounds):
        eng_s.append(timed(engine.step, args.steps))
        bare_s.append(timed(bare.step, args.steps))
    e, b = statistics.median(eng_s), statistics.median(bare_s)
    print(f"threads={torch.get_num_threads()} steps/round={args.steps} rounds={args.rounds}")
    print(f"{'loop':<10}{'s/step (median)':>18}{'all rounds':>40}")
    print(f"{'engine':<10}{e:>18.4f}{str([round(x, 4) for x in eng_s]):>40}")
    print(f"{'bare':<10}{b:>18.4f}{str([round(x, 4) for x in bare_s]):>40}")
    m = engine.step()
    parts = ["rollout_s", "generate_s", "reward_s", "queue_s", "train_s", "sync_s"]
    print("engine step breakdown: " + ", ".join(f"{p}={m['perf/' + p]:.4f}" for p in parts))
    print(f"headline: engine_overhead = {e / b:.2f}")


if __name__ == "__main__":
    main()
