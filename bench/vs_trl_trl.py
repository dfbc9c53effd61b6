"""bench/vs_trl.py's TRL side: our prompts, reward and GRPO settings handed to TRL's
GRPOTrainer, which is timed per phase. TRL is a bench-only dependency (`pip install -e
'.[bench]'`)."""

from __future__ import annotations

import os
import time
from typing import Any

from bench.vs_trl_report import summarize
from bench.vs_trl_tasks import NEW_TOKENS, TASKS, G, bench_config, task_policy


def trl_dataset(cfg, tokenizer, n_prompts: int):
    """Our sampler's first `n_prompts` prompts, in order, rendered exactly as our engine sees
    them (checked token for token)."""
    from datasets import Dataset
    from relax_core.data.cursor import DatasetCursor
    from relax_core.data.templates import render_prompt
    from relax_core.roles.media import prompt_source

    source = prompt_source(cfg, "train", None, tokenizer)
    items, _ = source.take(DatasetCursor(), n_prompts)
    d = cfg.data
    texts = [
        render_prompt(i.row["prompt"], d.template, tokenizer, d.system_prompt or None)
        for i in items
    ]
    for text, item in zip(texts, items, strict=True):
        if tokenizer(text)["input_ids"] != item.prompt_ids:
            raise RuntimeError(f"TRL would tokenize {text!r} differently from our engine")
    return Dataset.from_list(
        [{"prompt": t, "row": i.prompt_index} for t, i in zip(texts, items, strict=True)]
    ), source.rows


def trl_reward(reward_fn, rows: list[dict]):
    """Our reward as a TRL reward function (completions are decoded without special tokens on
    both sides)."""
    from relax_core.rewards import score_batch

    def math_reward(prompts, completions, row, **_: Any) -> list[float]:
        samples = [rows[i] for i in row]
        results, _ = score_batch(reward_fn, completions, [s["answer"] for s in samples], samples)
        return [r.reward for r in results]

    return math_reward


def trl_args(cfg, work: str, steps: int):
    from trl import GRPOConfig

    a, t, r = cfg.algorithm, cfg.train, cfg.rollout
    return GRPOConfig(
        output_dir=os.path.join(work, "trl"),
        max_steps=steps,
        per_device_train_batch_size=r.groups_per_step * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=NEW_TOKENS,
        temperature=r.temperature,
        top_p=r.top_p,
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",  # torch.optim.AdamW, as ours (TRL's default on CPU is the fused one)
        adam_beta1=0.9,
        adam_beta2=0.99,
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        beta=0.0,
        epsilon=a.eps_clip,
        epsilon_high=a.eps_clip_high,
        num_iterations=1,
        loss_type="dapo",
        scale_rewards="group" if a.normalize_adv_std else "none",
        seed=cfg.seed,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        use_vllm=False,
        shuffle_dataset=False,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=10,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def worker_trl(
    task: str, steps: int, eval_every: int, warmup: int, work: str, seed: int = 0
) -> dict:
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from relax_core.models.policy import load_policy
    from relax_core.rewards.registry import build_reward
    from relax_core.roles.evaluation import evaluate
    from relax_core.roles.media import prompt_source
    from relax_core.rollout.torch_engine import TorchEngine

    cfg = bench_config(task, work, steps, eval_every, seed=seed)
    model, tokenizer = load_policy(task_policy(cfg, task), cfg.model.dtype)
    data, rows = trl_dataset(cfg, tokenizer, steps * cfg.rollout.groups_per_step)
    reward_fn = build_reward(cfg.reward)
    eval_source = prompt_source(cfg, "eval", None, tokenizer)

    def held_out() -> float:
        engine = TorchEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)
        try:
            return evaluate(
                engine, tokenizer, eval_source, reward_fn, NEW_TOKENS, cfg.data.eval_size
            )["eval/accuracy"]
        finally:
            model.train()

    class Timed(GRPOTrainer):
        """Times TRL's generation and its generate-and-score phase; counts sampled tokens."""

        probe: dict[str, float] = {}

        def _generate_single_turn(self, *args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*args, **kwargs)
            self.probe["generate"] = self.probe.get("generate", 0.0) + time.perf_counter() - t0
            return out

        def compute_loss(self, *args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            out = super().compute_loss(*args, **kwargs)
            self.probe["loss"] = self.probe.get("loss", 0.0) + time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.probe["rollout"] = self.probe.get("rollout", 0.0) + time.perf_counter() - t0
            self.probe["tokens"] = float(out["completion_mask"].sum())
            return out

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.records: list[dict[str, float]] = []
            self.evals = [(0, held_out())]
            self.last = self.opt0 = self.opt = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 0:
                self.last = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.opt0 = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.opt = time.perf_counter() - self.opt0

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            p, step_s = trainer.probe, now - self.last
            self.records.append(trl_step_parts(p, self.opt, step_s))
            trainer.probe = {}
            s = state.global_step
            if s % eval_every == 0 or s == steps:
                self.evals.append((s, held_out()))
            self.last = time.perf_counter()

    torch.manual_seed(cfg.seed)
    clock = Clock()
    trainer = Timed(
        model=model,
        reward_funcs=trl_reward(reward_fn, rows),
        args=trl_args(cfg, work, steps),
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    result = summarize(clock.records, clock.evals, warmup, TASKS[task].target)
    result["optimizer"] = str(trainer.args.optim)
    return result


def trl_step_parts(probe: dict[str, float], opt: float, step_s: float) -> dict[str, float]:
    gen, rollout = probe.get("generate", 0.0), probe.get("rollout", 0.0)
    loss = probe.get("loss", 0.0)
    parts = {
        "generate": gen,
        "reward + advantages + padding": rollout - gen,
        "log-prob forward + loss": loss,
        "backward + grad clip + Trainer loop": step_s - rollout - loss - opt,
        "optimizer step": opt,
    }
    return {"step_s": step_s, "tokens": probe.get("tokens", 0.0), **parts}
