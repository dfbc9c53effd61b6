"""LoRA runs end to end: colocate and async (adapters over the gloo broadcast group) train the
same adapter at max_staleness 0, the base never moves, and each checkpoint is base + adapter."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from safetensors.torch import load_file

from relax_core.models import lora
from relax_core.models.lora import ADAPTER_DIR
from relax_core.models.omni import WEIGHTS_FILE as OMNI_WEIGHTS
from relax_core.models.policy import load_policy
from relax_core.queue import TransferQueue
from relax_core.roles.reference import add_ref_logprobs
from relax_core.train.checkpoint import list_checkpoints, read_state
from tests.integration.test_async_run import ASYNC, _final, _finish, _metrics, _run

pytestmark = pytest.mark.integration

LORA = {
    "train": {"total_steps": 4, "checkpoint_every": 2, "lr": 5e-3, "lora": {"rank": 4}},
    # The entropy bonus gives every step a gradient; the KL term scores the base policy, the
    # LoRA policy with its adapters off (colocate) or the starting policy (async's reference).
    "algorithm": {"entropy_coef": 0.01, "kl_coef": 0.01},
}


def _adapter(ckpt: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(ckpt, ADAPTER_DIR, "adapter_model.safetensors"))


def test_lora_trains_the_same_adapter_in_both_modes_on_a_frozen_base(small_config, workdir):
    registered = {"tracking": {"registered_model": "lora-policy"}}
    c_cfg = small_config("c.yaml", run_name="c", **LORA, **registered)
    _finish(_run(c_cfg))
    _finish(_run(small_config("a.yaml", run_name="a", **LORA, **ASYNC)))

    c_ckpt, a_ckpt = _final(workdir, "c"), _final(workdir, "a")
    assert read_state(a_ckpt)["policy_version"] == 4
    first = min(list_checkpoints(os.path.dirname(c_ckpt)))
    start_base = load_file(os.path.join(first, "model.safetensors"))
    for ckpt in (c_ckpt, a_ckpt):
        base = load_file(os.path.join(ckpt, "model.safetensors"))
        assert base.keys() == start_base.keys()
        for name, tensor in base.items():
            assert torch.equal(tensor, start_base[name]), name  # the base never trains
        assert not os.path.exists(os.path.join(ckpt, "master.safetensors"))
    c_adapter, a_adapter = _adapter(c_ckpt), _adapter(a_ckpt)
    assert any(t.abs().sum() > 0 for n, t in c_adapter.items() if "lora_B" in n)  # it learned
    assert c_adapter.keys() == a_adapter.keys()
    for name, tensor in c_adapter.items():
        # Strict on-policy async: rollout sampled with every new adapter, as colocate did.
        torch.testing.assert_close(a_adapter[name], tensor, rtol=0, atol=1e-6)
    _check_registered_lora_policy(c_cfg, c_ckpt, c_adapter, workdir)


def _check_registered_lora_policy(cfg_path, ckpt, adapter, workdir) -> None:
    """The registered model is the final base + adapter pair: served as a pyfunc it holds the
    trained adapter, and evaluating it is evaluating the final checkpoint."""
    import mlflow

    from relax_core.config import load_config
    from relax_core.run.evaluate import evaluate_checkpoint
    from relax_core.run.session import RunSession

    cfg = load_config(cfg_path)
    # A colocate session's torch engine shares the trainer's frozen base, not a copy of it,
    # and holds adapters of its own, equal to the trainer's after a sync.
    session = RunSession.from_checkpoint(cfg, ckpt)
    engine, trainer = session.engine.model, session.model
    for (name, mine), theirs in zip(engine.named_parameters(), trainer.parameters(), strict=True):
        if ".lora_" in name:
            assert mine is not theirs and torch.equal(mine, theirs), name
        else:
            assert mine is theirs, name
    session.close()
    ev = evaluate_checkpoint(cfg, "", k=2, n_samples=2, model="models:/lora-policy/latest")
    assert ev["checkpoint"] == "models:/lora-policy/1" and ev["policy_version"] == 4
    final_eval = _metrics(workdir, read_state(ckpt)["tracking_run_id"], "eval/accuracy")[-1]
    assert ev["eval_accuracy"] == final_eval
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    served = mlflow.pyfunc.load_model("models:/lora-policy/1").unwrap_python_model().model
    held = {
        f"base_model.model.{n}".replace(".default.", "."): t
        for n, t in lora.adapter_weights(served)
    }
    assert held.keys() == adapter.keys()
    for name, tensor in adapter.items():
        assert torch.equal(held[name], tensor), name


def _versions(run_dir: str) -> dict[int, str]:
    """Each kept checkpoint of a run by the policy version it holds."""
    return {read_state(c)["policy_version"]: c for c in list_checkpoints(run_dir)}


def test_async_engines_sample_with_the_adapter_version_they_report(small_config, workdir):
    """max_staleness 1 over several versions, adapters through the object store: every rollout
    row must have been sampled with the adapter of the version it is stamped with (its log-probs are that checkpoint's, not the
    starting adapter's nor the one before), and no row trains more than one version late."""
    steps = 6
    cfg = small_config(
        "s.yaml",
        run_name="s",
        mode="async",
        rollout={"max_staleness": 1},
        # A large learning rate: each version's adapter scores the samples measurably apart.
        train={"total_steps": steps, "checkpoint_every": 1, "lr": 3e-2, "lora": {"rank": 4}},
        algorithm={"entropy_coef": 0.01},
        queue={"keep_versions": 100},
        # Adapters through the object store (the broadcast group is the other tests'), to the
        # rollout engine and to actor_fwd.
        services={**ASYNC["services"], "weight_sync": "object_store", "actor_fwd": True},
    )
    _finish(_run(cfg))
    final = _final(workdir, "s")
    state = read_state(final)
    assert state["policy_version"] == steps
    checkpoints = _versions(os.path.dirname(final))
    assert sorted(checkpoints) == list(range(steps + 1))
    staleness = _metrics(workdir, state["tracking_run_id"], "train/staleness_max")
    assert len(staleness) == steps and max(staleness) <= 1

    queue = TransferQueue(".relax/queue", state["run_id"])
    tables = [queue.read("rollout", seq) for seq in queue.committed("rollout")]
    by_version: dict[int, list] = {}
    for table in tables:
        for v in set(table.column("behaviour_version_min").to_pylist()):
            rows = pc.equal(table.column("behaviour_version_min"), v)
            by_version.setdefault(v, []).append(table.filter(rows))
    assert len(by_version) >= 4, sorted(by_version)  # several adapter versions sampled
    gaps_own, gaps_before = [], []
    for v, parts in sorted(by_version.items()):
        table = pa.concat_tables(parts)
        assert table.column("behaviour_version_max").to_pylist() == [v] * table.num_rows
        sampled = [torch.tensor(r) for r in table.column("rollout_logprobs").to_pylist()]
        for at, gaps in ((v, gaps_own), (v - 1, gaps_before)):
            if at < 0:
                continue
            model, tok = load_policy(checkpoints[at])
            scored = add_ref_logprobs(model, table, tok.pad_token_id, 4096, 1.0)
            rescored = [torch.tensor(r) for r in scored.column("ref_logprobs").to_pylist()]
            gaps.append(
                max(float((a - b).abs().max()) for a, b in zip(sampled, rescored, strict=True))
            )
    # The engine's log-probs are the trainer's at the stamped version, and the version before
    # (what an engine whose update never landed would hold) is far off.
    assert max(gaps_own) < 1e-4, gaps_own
    assert min(gaps_before) > 1e-2, gaps_before


def test_fsdp_lora_runs_in_both_modes_with_the_base_as_kl_anchor(small_config, workdir):
    """FSDP2 LoRA: colocate on one rank scores its KL anchor through the sharded policy with
    adapters off; async on two ranks (torchrun, gloo) syncs the gathered adapter, evaluates on
    a copy filled with it and checkpoints base + adapter. (That FSDP2 ranks train one process's
    adapter and resume it exactly is test_fsdp.py's.)"""
    fsdp = {
        "train": {**LORA["train"], "eval_every": 2, "backend": "fsdp"},
        "algorithm": LORA["algorithm"],
    }
    _finish(_run(small_config("f.yaml", run_name="f", **fsdp)))
    two_ranks = {**ASYNC["services"], "trainer_gpus": 2}
    _finish(_run(small_config("r.yaml", run_name="r", **fsdp, **{**ASYNC, "services": two_ranks})))

    for run in ("f", "r"):
        final = _final(workdir, run)
        state = read_state(final)
        assert state["policy_version"] == 4
        assert os.path.isfile(os.path.join(final, "optim", "optimizer.pt"))
        start = min(list_checkpoints(os.path.dirname(final)))
        start_base = load_file(os.path.join(start, "model.safetensors"))
        for name, tensor in load_file(os.path.join(final, "model.safetensors")).items():
            assert torch.equal(tensor, start_base[name]), name  # the base never trains
        assert any(t.abs().sum() > 0 for n, t in _adapter(final).items() if "lora_B" in n)
        assert len(_metrics(workdir, state["tracking_run_id"], "eval/accuracy")) >= 2
        kl = _metrics(workdir, state["tracking_run_id"], "train/kl")
        if run == "f":
            # The anchor is the base: the policy equals it until the adapter first trains
            # (B starts at zero), and parts from it after.
            assert abs(kl[0]) < 1e-7 and kl[-1] > 1e-6, kl


def test_the_tiny_omni_policy_trains_lora_adapters_on_its_lm_and_encoders(small_config, workdir):
    """Omni + LoRA, async (the reference role and the rollout engine rebuild media from the
    rows): adapters on the LM's projections and on two encoder layers; the base (LM and
    encoders) stays frozen and the checkpoint is an omni base + adapter that loads back."""
    from tests.integration.test_omni_run import OMNI, _dataset

    _dataset(workdir)
    targets = "q_proj,v_proj,gate_proj,audio_out,video_out"
    train = {**OMNI["train"], "lr": 1e-2, "lora": {"rank": 4, "target_modules": targets}}
    # The entropy bonus gives every step a gradient, whatever the rewards.
    algorithm = {**OMNI["algorithm"], "entropy_coef": 0.01}
    sections = {**OMNI, "train": train, "algorithm": algorithm, **ASYNC}
    _finish(_run(small_config("o.yaml", **sections, run_name="o")))

    final = _final(workdir, "o")
    assert read_state(final)["policy_version"] == 3
    start = min(list_checkpoints(os.path.dirname(final)))
    for name in ("model.safetensors", OMNI_WEIGHTS):
        before, after = load_file(os.path.join(start, name)), load_file(os.path.join(final, name))
        assert before.keys() == after.keys() and all(
            torch.equal(after[k], t) for k, t in before.items()
        ), name
    adapter = _adapter(final)
    trained = {n for n, t in adapter.items() if "lora_B" in n and t.abs().sum() > 0}
    assert any(".lm." in n for n in trained) and any("audio_out" in n for n in trained), trained
    policy, _ = load_policy(final)
    assert lora.is_lora(policy) and type(policy).__name__ == "TinyOmni"
    state = {k: v for k, v in policy.state_dict().items() if ".lora_" in k}
    assert len(state) == len(adapter)
