"""Same settings learn alike: the colocate engine's GRPO update is the textbook one.

A plain PyTorch GRPO update as TRL's GRPOTrainer does it with `loss_type="dapo"` and one
update per step (whole sequences, left-padded prompts, ratio against the detached log-probs,
PPO clip, token mean over the step batch, grad clip, AdamW) is applied to a copy of the policy,
on the very rows the engine trained on at each step. If the engine's loss, micro-batching,
shared-prompt forward or optimizer drifted from that, the two models would part within a step.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

import relax_core.run.colocate as colocate
from relax_core.config import load_config, replace
from relax_core.data.dataset import fingerprint
from relax_core.run.prepare import PolicySpec, prepare_policy
from relax_core.run.session import RunSession
from relax_core.train.run_state import RunState

pytestmark = [pytest.mark.integration]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def reference_step(model, optimizer, table, eps_low: float, eps_high: float) -> float:
    prompts = table.column("prompt_ids").to_pylist()
    responses = table.column("response_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    adv = torch.tensor([a[0] for a in table.column("advantages").to_pylist()])
    lp, lr = max(map(len, prompts)), max(map(len, responses))
    ids = torch.tensor(
        [
            [0] * (lp - len(p)) + p + r + [0] * (lr - len(r))
            for p, r in zip(prompts, responses, strict=True)
        ]
    )
    attn = torch.tensor(
        [[0] * (lp - len(p)) + [1] * (len(p) + len(r)) + [0] * (lr - len(r))
         for p, r in zip(prompts, responses, strict=True)]
    )  # fmt: skip
    mask = torch.tensor([list(m) + [0] * (lr - len(m)) for m in masks], dtype=torch.float32)
    positions = (attn.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits
    logp = torch.log_softmax(logits[:, lp - 1 : -1].float(), -1)
    logp = logp.gather(-1, ids[:, lp:].unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - logp.detach())
    a = adv[:, None]
    per_token = torch.max(-a * ratio, -a * ratio.clamp(1 - eps_low, 1 + eps_high))
    loss = (per_token * mask).sum() / mask.sum()
    optimizer.zero_grad()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return float(norm)


@pytest.mark.slow
def test_the_engine_update_equals_a_plain_grpo_update_on_its_rows(workdir, monkeypatch):
    torch.set_num_threads(1)
    cfg = load_config(os.path.join(REPO, "configs", "cpu-default.yaml"))
    cfg = replace(
        cfg,
        warm_start={"steps": 40},
        # float32 matmuls: the reference runs whole sequences, another batch shape, where bf16
        # matmuls would round apart by more than the float32 summation order this test allows
        model={"matmul_dtype": ""},
        data={
            "train_path": os.path.join(REPO, cfg.data.train_path),
            "eval_path": os.path.join(REPO, cfg.data.eval_path),
        },
        rollout={"groups_per_step": 16},
        queue={"root": str(workdir / "queue")},
        checkpoint={"dir": str(workdir / "ckpt"), "policy_cache_dir": str(workdir / "policies")},
        tracking={"tracking_uri": f"sqlite:///{workdir}/mlflow.db", "progress": False},
    )
    policy = prepare_policy(
        PolicySpec.of(cfg, fingerprint(cfg.data.train_path)), cfg.checkpoint.policy_cache_dir
    )
    session = RunSession(cfg, policy, RunState(run_id="reference"))
    controller = colocate.ColocateController(session)
    trained = session.backend.model
    reference = copy.deepcopy(trained).train()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=cfg.train.lr, betas=(0.9, 0.99))
    tables = []
    real = colocate.train_on_table

    def keep_rows(backend, table, *args, **kwargs):
        tables.append(table)
        return real(backend, table, *args, **kwargs)

    monkeypatch.setattr(colocate, "train_on_table", keep_rows)
    a = cfg.algorithm
    for step in range(4):
        metrics = controller.step()
        norm = reference_step(reference, optimizer, tables[-1], a.eps_clip, a.eps_clip_high)
        assert metrics["train/grad_norm"] == pytest.approx(norm, rel=1e-4), step
        gap = max(
            float((x - y).abs().max())
            for x, y in zip(trained.parameters(), reference.parameters(), strict=True)
        )
        # One AdamW step moves a weight by up to lr (1e-3); float summation order alone leaves
        # ~1e-5. A different loss, aggregation or optimizer gives gaps of lr's order at once.
        assert gap < 5e-5, (step, gap)
