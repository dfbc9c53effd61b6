"""A bare GRPO loop in plain PyTorch + transformers: the CPU default without an engine.

Its own supervised warm start (the config's warm_start steps, lr, batch and target), then GRPO as
the config sets it, with held-out greedy accuracy every `--eval-every` steps; it stops at the
first eval at >= step 0 + `--target`. Both do the engine's math in the engine's order of
operations, so on one thread count a run gives the main job's weights and evals bit for bit: the
warm start's initial weights, batches and masked token-mean loss; then per step the engine's
prompt order, each distinct prompt prefilled once, the engine's sampler, finished rows leaving
the decode batch once they are a quarter of it, token-budget micro-batches (longest rows first)
whose distinct prompts run once in the training forward (under `model.matmul_dtype`, in one
packed pass with the responses, without padding), groups whose advantages are all 0 left out of the training
forward (train.skip_inert_groups), the LM head on real tokens only, group-normalized
advantages, PPO clip, token-mean loss, AdamW (0.9, 0.99), grad clip. `bench/overhead.py --check`
compares the steps and lists what the engine does besides.

Reuses from relax_core only the config reader, the dataset reader, the character tokenizer, the
tiny Qwen3 builder (the same initial weights for a seed), the config's reward function (the
answer check), the process's kernel setting (train.deterministic), the sizes a CPU pass is
rounded to (`bucket_length`) and, with `model.matmul_dtype`, the float32 attention the engine's
policies use. Under that setting the warm start's training forward, sampling, training and
evals run under autocast to the matmul dtype (the warm start's probe in float32, as the
engine's): linear layers in bfloat16, the residual stream, norms and attention in float32, the
numerics of the engine's trainer and, bit for bit, of its sampling copy
(relax_core/models/precision.py). Prompts must share one length and the template be 'plain'.

    python bench/bare_grpo.py [--cfg configs/cpu-default.yaml] [--seed 0] [--target 0.30]

Prints one JSON line: each eval's step, accuracy, wall seconds since this script started
(before torch's import) and epoch time, and `time_to_target_s` (null when not reached).
"""

from __future__ import annotations

import os
import sys
import time

T0 = time.time()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# As a script, bench/ leads sys.path and bench/queue.py would shadow the standard library's.
if sys.path and os.path.abspath(sys.path[0]) == os.path.join(REPO, "bench"):
    sys.path[0] = REPO

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from relax_core.models.precision import bucket_length, resolve_matmul_dtype  # noqa: E402
from relax_core.train.determinism import use_deterministic_kernels  # noqa: E402


def adamw(model, lr: float) -> torch.optim.AdamW:
    # fused, as the engine's trainer on a CPU
    return torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0, fused=True
    )


def response_logp(model, hidden, tokens, real, temperature: float) -> torch.Tensor:
    """[B, R] log-probs of `tokens` from the hidden states predicting them; as the engine's
    trainer, the LM head sees real tokens only (`real` [B, R] bool), their count padded with
    zero rows to 8 lengths an octave (one oneDNN kernel per length), and padding reads 0."""
    x, n = hidden[real], int(real.sum())
    logits = model.lm_head(torch.cat([x, x.new_zeros(bucket_length(n) - n, x.shape[1])]))[:n]
    logits = logits.float()
    logits = logits / temperature if temperature != 1.0 else logits
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[real].unsqueeze(-1)).squeeze(-1)
    return torch.zeros(tokens.shape).masked_scatter(real, logp)


def numerics(model, matmuls: torch.dtype | None, attention: bool = False):
    """The engine's numerics for `model` under `model.matmul_dtype` (`matmuls`, None for
    float32): float32 attention set on the model (with `matmuls`, or `attention`: any setting,
    'auto' decided float32 too), and a function giving the context a forward runs in (autocast, or nothing)."""
    if matmuls is None and not attention:
        return contextlib.nullcontext
    from relax_core.models.attention import use_float32_attention

    use_float32_attention(model)
    return lambda: torch.autocast("cpu", dtype=matmuls) if matmuls else contextlib.nullcontext()


def one_pass(decoder, ids, row, resp, real) -> torch.Tensor:
    """[B, R, d] hidden states as the engine's trainer computes them under float32 attention:
    the distinct prompts' tokens (all of one length here) and the rows' real response inputs as
    one row, rounded up to 8 lengths an octave, laid out padded inside attention only."""
    from relax_core.models.attention import PackedPrompts, PackedResponses

    (count, plen), (rows, width) = ids.shape, resp.shape
    w, m, inputs = width - 1, ids.numel(), real[:, 1:]
    index = inputs.reshape(-1).nonzero().squeeze(1)
    n, causal = index.numel(), torch.ones(plen + w, plen + w, dtype=torch.bool).tril()
    seen = causal[:plen, :plen].expand(count, 1, -1, -1)
    prompts = PackedPrompts(torch.arange(m), count, plen, seen)
    mask = torch.cat(
        [torch.ones(rows, w, plen, dtype=torch.bool), causal[:w, :w] & inputs.unsqueeze(1)], 2
    ).unsqueeze(1)
    extra = torch.zeros(bucket_length(m + n) - m - n, dtype=torch.long)
    positions = (plen + torch.arange(w)).repeat(rows).index_select(0, index)
    hidden = decoder(
        input_ids=torch.cat([ids.reshape(-1), resp[:, :-1].reshape(-1)[index], extra])[None],
        position_ids=torch.cat([torch.arange(plen).repeat(count), positions, extra])[None],
        attention_mask=torch.ones(1, 1, 1, 1, dtype=torch.bool),  # prepared: none built
        use_cache=False,
        packed=PackedResponses(prompts, row, index, w, n, mask),
    ).last_hidden_state[0]
    first = hidden[plen - 1 : m : plen].index_select(0, row)
    slots = torch.cat([torch.arange(rows) * width, (index // w) * width + index % w + 1])
    out = hidden.new_zeros(rows * width, hidden.shape[-1])
    return out.index_copy(0, slots, torch.cat([first, hidden[m : m + n]])).view(rows, width, -1)


def two_passes(decoder, ids, row, resp) -> torch.Tensor:
    """[B, R, d]: a prompt pass (the count bucketed, as the engine's), responses padded on top."""
    cache, every = DynamicCache(), torch.arange(bucket_length(len(ids))).clamp(max=len(ids) - 1)
    out = decoder(input_ids=ids[every], past_key_values=cache, use_cache=True)
    # index_select, not x[row]: its backward adds a prompt's rows in a fixed order.
    first = out.last_hidden_state[:, -1].index_select(0, row).unsqueeze(1)
    if resp.shape[1] == 1:
        return first
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, row)
        layer.values = layer.values.index_select(0, row)
    rest = decoder(input_ids=resp[:, :-1], past_key_values=cache, use_cache=True)
    return torch.cat([first, rest.last_hidden_state], 1)


def matmul_dtype(cfg) -> torch.dtype | None:
    return getattr(torch, n) if (n := resolve_matmul_dtype(cfg.model.matmul_dtype)) else None


def warm_start(
    model,
    tok,
    rows: list[dict],
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    target: float,
    matmuls: torch.dtype | None = None,
    per_length: bool = False,
) -> int:
    """Next-token loss on answer + EOS, token mean, the engine's batches for `seed`; as in the
    engine, right padding masked and the LM head only where an answer token is predicted. With
    a `target` accuracy, the engine's probe (held out; checked before the first step and every
    10 steps: every answer token the greedy choice, in float32) ends it early. `matmuls`: the
    training forward under autocast to it, attention in float32. `per_length`: the target
    holds on each answer length (EOS included) that is a tenth of the probe or more, as the
    engine's warm_start.target_per_length. Returns the steps taken."""
    compute = numerics(model, matmuls)
    opt, rng, eos, pad = adamw(model, lr), random.Random(seed), tok.eos_token_id, tok.pad_token_id
    prompts = tok([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    answers = [
        a + [eos] for a in tok([r["answer"] for r in rows], add_special_tokens=False)["input_ids"]
    ]

    def forward(picks: list[int]):
        p, width = len(prompts[picks[0]]), max(len(answers[i]) for i in picks)
        x = torch.tensor(
            [prompts[i] + answers[i] + [pad] * (width - len(answers[i])) for i in picks]
        )
        mask = torch.arange(width) < torch.tensor([len(answers[i]) for i in picks]).unsqueeze(1)
        seen = torch.cat([torch.ones(len(picks), p, dtype=torch.long), mask.long()], 1)
        hidden = model.get_decoder()(input_ids=x, attention_mask=seen).last_hidden_state
        return hidden[:, p - 1 : p - 1 + width], x[:, p:], mask

    train, probe = list(range(len(rows))), []
    if target > 0:
        probe = sorted(
            random.Random(f"warm-start-probe-{seed}").sample(train, min(256, len(rows) // 10))
        )
        held = set(probe)
        train = [i for i in train if i not in held]

    def probe_accuracy() -> float:
        with torch.no_grad():
            hidden, tokens, mask = forward(probe)
            best = model.lm_head(hidden[mask]).argmax(-1)
            hit = torch.ones(tokens.shape, dtype=torch.bool).masked_scatter(
                mask, best == tokens[mask]
            )
            right = hit.all(1)
            if not per_length:
                return float(right.float().mean())
            lengths = mask.sum(1)
            common = [
                n for n in lengths.unique().tolist() if (lengths == n).sum() * 10 >= len(probe)
            ]
            if not common:
                return float(right.float().mean())
            return min(float(right[lengths == n].float().mean()) for n in common)

    for step in range(steps + 1):
        if probe and step % 10 == 0 and probe_accuracy() >= target:
            return step
        if step == steps:
            return step
        picks = [train[i] for i in rng.sample(range(len(train)), min(batch, len(train)))]
        with compute():
            hidden, tokens, mask = forward(picks)
            logp = response_logp(model, hidden, tokens, mask, 1.0)
        loss = -(logp * mask.float()).sum() / mask.float().sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return steps


class BareGRPO:
    def __init__(self, model, tok, rows: list[dict], cfg, seed: int, reward) -> None:
        self.model, self.tok, self.rows, self.cfg, self.seed = model, tok, rows, cfg, seed
        self.reward, self.eos, self.pad = reward, tok.eos_token_id, tok.pad_token_id
        self.opt, self.gen = adamw(model, cfg.train.lr), torch.Generator().manual_seed(seed)
        self.ids: dict[int, list[int]] = {}  # prompt tokens, cached as the engine's source
        # The engine's kernels: train.deterministic sets them for the whole process, so a
        # comparison must run on the same ones.
        use_deterministic_kernels(cfg.train.deterministic)
        self.epoch, self.pos, self.order = 0, 0, None
        self.compute = numerics(model, matmul_dtype(cfg), bool(cfg.model.matmul_dtype))
        self.packed = self.compute is not contextlib.nullcontext  # as the engine's trainer packs

    def next_prompts(self, n: int) -> list[int]:
        """The engine's order: one permutation of the dataset per (seed, epoch)."""
        out: list[int] = []
        while len(out) < n:
            if self.order is None:
                rng = np.random.default_rng([self.seed, self.epoch])
                shuffled = self.cfg.data.shuffle
                self.order = (
                    rng.permutation(len(self.rows)) if shuffled else np.arange(len(self.rows))
                )
            take = self.order[self.pos : self.pos + n - len(out)].tolist()
            out, self.pos = out + take, self.pos + len(take)
            if self.pos == len(self.rows):
                self.epoch, self.pos, self.order = self.epoch + 1, 0, None
        return out

    def forward(self, ids, cache):  # the LM head at the last position only, as the engine
        with self.compute():
            out = self.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    @torch.inference_mode()
    def sample(self, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[G, P] prompts -> responses [G*n, R] (pad after EOS) and their lengths [G*n]."""
        r, cache = self.cfg.rollout, DynamicCache()
        rows = torch.arange(len(prompts)).repeat_interleave(r.n_samples_per_prompt)
        logits = self.forward(prompts, cache)[rows]  # each prompt prefilled once
        cache.batch_select_indices(rows)
        rows = torch.arange(len(rows))
        tokens = torch.full((len(rows), r.max_new_tokens), self.pad)
        lengths = torch.full((len(rows),), r.max_new_tokens)
        done = torch.zeros(len(rows), dtype=torch.bool)
        for t in range(r.max_new_tokens):
            # The engine's sampler: each row's float64 CDF inverted at one uniform draw.
            cdf = torch.log_softmax(logits.float() / r.temperature, -1).exp().double().cumsum(-1)
            u = torch.rand(len(cdf), generator=self.gen, dtype=torch.float64)
            tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
            tok = tok.clamp(max=cdf.shape[-1] - 1)
            live = ~done[rows]
            tokens[rows, t] = tok = tok.masked_fill(~live, self.pad)
            ended = rows[live & (tok == self.eos)]
            lengths[ended], done[ended] = t + 1, True
            if bool(done.all()) or t + 1 == r.max_new_tokens:
                break
            if int(done[rows].sum()) * 4 >= len(rows):  # finished rows leave the batch
                keep = (~done[rows]).nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                rows, tok = rows[keep], tok[keep]
            logits = self.forward(tok.unsqueeze(-1), cache)
        return tokens, lengths

    def train(self, prompts, tokens, lengths, adv) -> None:
        c, decoder = self.cfg, self.model.get_decoder()
        seq, micro = (prompts.shape[1] + lengths).tolist(), [[]]
        rows, g, a = range(len(seq)), c.rollout.n_samples_per_prompt, c.algorithm
        if c.train.skip_inert_groups and a.kl_coef == 0 and a.entropy_coef == 0:
            live = adv.view(-1, g).ne(0).any(1).tolist()
            live[0] = live[0] or not any(live)  # inert groups out, as the engine (one stays)
            rows = [i for i in rows if live[i // g]]
        for i in sorted(rows, key=lambda i: -seq[i]):  # longest first, as the engine
            if micro[-1] and seq[micro[-1][0]] * (len(micro[-1]) + 1) > c.train.micro_batch_tokens:
                micro.append([])
            micro[-1].append(i)
        num_tokens = float(lengths.sum())
        self.opt.zero_grad(set_to_none=True)
        for mb in map(torch.tensor, micro):
            width = int(lengths[mb].max())
            resp, real = tokens[mb, :width], torch.arange(width) < lengths[mb, None]
            index: dict[int, int] = {}  # the micro-batch's distinct prompts, first seen first
            groups = (mb // c.rollout.n_samples_per_prompt).tolist()
            row = torch.tensor([index.setdefault(g, len(index)) for g in groups])
            with self.compute():
                if width > 1 and self.packed:  # prompts and responses in one packed pass
                    hidden = one_pass(decoder, prompts[list(index)], row, resp, real)
                else:
                    hidden = two_passes(decoder, prompts[list(index)], row, resp)
                logp = response_logp(self.model, hidden, resp, real, c.rollout.temperature)
            ratio = torch.exp(logp - logp.detach())  # on-policy: the old log-probs are these
            a, lo, hi = adv[mb, None], c.algorithm.eps_clip, c.algorithm.eps_clip_high
            pg = torch.maximum(-a * ratio, -a * ratio.clamp(1 - lo, 1 + hi))
            ((pg * real.float()).sum() / num_tokens).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.train.grad_clip)
        self.opt.step()

    def step(self) -> dict[str, float]:
        r, t0 = self.cfg.rollout, time.perf_counter()
        picks = self.next_prompts(r.groups_per_step)
        new = [i for i in dict.fromkeys(picks) if i not in self.ids]
        texts = [self.rows[i]["prompt"] for i in new]
        ids = self.tok(texts, add_special_tokens=False)["input_ids"]
        self.ids.update(zip(new, ids, strict=True))
        prompts = torch.tensor([self.ids[i] for i in picks])
        tokens, lengths = self.sample(prompts)
        t1 = time.perf_counter()
        ends = zip(tokens.tolist(), lengths.tolist(), strict=True)
        texts = self.tok.batch_decode([t[:k] for t, k in ends], skip_special_tokens=True)
        rows = [self.rows[i] for i in picks for _ in range(r.n_samples_per_prompt)]
        scores = [
            self.reward(x, row["answer"], row).reward for x, row in zip(texts, rows, strict=True)
        ]
        g = torch.tensor(scores, dtype=torch.float32).view(len(picks), -1)
        centered = g - g.mean(1, keepdim=True)  # population std, as the engine's two passes
        adv = (centered / (centered.square().mean(1, keepdim=True).sqrt() + 1e-6)).flatten()
        t2 = time.perf_counter()
        self.train(prompts, tokens, lengths, adv)
        t3 = time.perf_counter()
        times = {"generate_s": t1 - t0, "reward_s": t2 - t1, "train_s": t3 - t2}
        return {**times, "reward_mean": float(g.mean())}

    @torch.inference_mode()
    def accuracy(self, ids: torch.Tensor, rows: list[dict]) -> float:
        """Greedy accuracy on `rows` (prompt tokens `ids` [N, P]), as the engine's eval."""
        cache, out = DynamicCache(), []
        for _ in range(self.cfg.rollout.max_new_tokens):
            ids = self.forward(ids, cache).argmax(-1, keepdim=True)
            out.append(ids)
            if bool((torch.cat(out, 1) == self.eos).any(1).all()):
                break
        resp = [
            r[: r.index(self.eos) + 1] if self.eos in r else r for r in torch.cat(out, 1).tolist()
        ]
        texts = self.tok.batch_decode(resp, skip_special_tokens=True)
        correct = sum(
            self.reward(x, r["answer"], r).correct for x, r in zip(texts, rows, strict=True)
        )
        return correct / len(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cfg", default=os.path.join(REPO, "configs", "cpu-default.yaml"))
    p.add_argument("--seed", type=int, default=None, help="default: the config's")
    p.add_argument("--eval-every", type=int, default=None, help="default: train.eval_every")
    p.add_argument("--target", type=float, default=0.30, help="accuracy gain over step 0")
    p.add_argument("--max-steps", type=int, default=None, help="default: train.total_steps")
    args = p.parse_args()
    from relax_core.config import load_config
    from relax_core.data.dataset import load_prompts
    from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
    from relax_core.rewards.registry import resolve_reward

    cfg = load_config(args.cfg)
    seed = cfg.seed if args.seed is None else args.seed
    every, steps = args.eval_every or cfg.train.eval_every, args.max_steps or cfg.train.total_steps
    rows = load_prompts(os.path.join(REPO, cfg.data.train_path))
    held_out = load_prompts(os.path.join(REPO, cfg.data.eval_path))[: cfg.data.eval_size]
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(cfg.model, len(tok), seed)
    w = cfg.warm_start
    warm = (w.steps, w.lr, w.batch_size, seed, w.target_accuracy, matmul_dtype(cfg))
    warm_start(model, tok, rows, *warm, w.target_per_length)
    loop = BareGRPO(model, tok, rows, cfg, seed, resolve_reward(cfg.reward.name))
    ids = torch.tensor(tok([r["prompt"] for r in held_out], add_special_tokens=False)["input_ids"])
    evals = [{"step": 0, "accuracy": loop.accuracy(ids, held_out), "time": time.time()}]
    step, base = 0, evals[0]["accuracy"]
    while step < steps and evals[-1]["accuracy"] - base < args.target - 1e-9:
        loop.step()
        step += 1
        if step % every == 0 or step == steps:
            evals.append(
                {"step": step, "accuracy": loop.accuracy(ids, held_out), "time": time.time()}
            )
    for e in evals:
        e["wall_s"] = round(e["time"] - T0, 3)
    reached = evals[-1]["accuracy"] - base >= args.target - 1e-9
    print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                      "seed": seed, "evals": evals,
                      "time_to_target_s": evals[-1]["wall_s"] if reached else None}))  # fmt: skip


if __name__ == "__main__":
    main()
