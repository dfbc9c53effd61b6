"""Omni rows through the roles: prompt sources with placeholders and encoder inputs, quarantine of
bad media recorded once per run, rows carrying media by reference, and the trainer's micro-batches
rebuilt from those references with the same encoder inputs the rollout used."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from relax_core.config import RunConfig, replace
from relax_core.data.dataset import load_prompts, write_prompts
from relax_core.models.omni import SPEC_FILE, TinyOmni
from relax_core.models.policy import load_policy
from relax_core.queue import TransferQueue, rows_to_table
from relax_core.rewards.registry import build_reward
from relax_core.roles.media import QUARANTINE, prompt_source, resolver_for
from relax_core.roles.rollout import rollout_groups
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.run.prepare import PolicySpec, prepare_policy
from relax_core.train.batching import table_micro_batches
from relax_core.train.torch_backend import response_logprobs

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("omni", os.path.join(REPO, "datasets", "omni.py"))
omni = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(omni)

MODEL = {
    "kind": "tiny-omni",
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
}


@pytest.fixture(scope="module")
def omni_run(tmp_path_factory):
    """A generated dataset (one audio clip corrupt, one video missing) and a prepared policy."""
    out = tmp_path_factory.mktemp("omni")
    train, eval_ = omni.generate(str(out), seed=0, per_modality=4, eval_per_modality=2)
    (out / train[5]["media"][0]["uri"]).write_bytes(b"\x00garbage")  # an audio clip
    os.remove(out / train[9]["media"][0]["uri"])  # a video
    write_prompts(train, str(out / "train.jsonl"))
    write_prompts(eval_, str(out / "eval.jsonl"))
    cfg = replace(
        RunConfig(),
        model=MODEL,
        warm_start={"steps": 2, "batch_size": 4},
        data={"train_path": str(out / "train.jsonl"), "eval_path": str(out / "eval.jsonl")},
        rollout={"n_samples_per_prompt": 2, "max_new_tokens": 2},
        reward={"name": "multiple_choice"},
    )
    policy_dir = prepare_policy(PolicySpec.of(cfg), str(out / "cache"))
    return cfg, policy_dir, out, train


def test_a_prepared_omni_policy_loads_as_one(omni_run):
    cfg, policy_dir, _, _ = omni_run
    assert os.path.isfile(os.path.join(policy_dir, SPEC_FILE))
    model, tok = load_policy(policy_dir)
    assert isinstance(model, TinyOmni) and model.spec.image_size == cfg.model.image_size
    assert tok.convert_ids_to_tokens(model.media_token_id) == "<media>"


def test_bad_media_rows_are_quarantined_once_per_run_with_their_reason(omni_run, tmp_path):
    cfg, policy_dir, out, train = omni_run
    model, tok = load_policy(policy_dir)
    queue = TransferQueue(str(tmp_path / "q"), "run")
    source = prompt_source(cfg, "train", model, tok, queue)
    assert len(source.rows) == len(train) - 2
    record = json.loads(queue.store.read_bytes(f"{QUARANTINE}/train.json"))
    assert [q["index"] for q in record["quarantined"]] == [5, 9]
    assert "unreadable audio" in record["quarantined"][0]["reason"]
    assert "not found" in record["quarantined"][1]["reason"]
    # Another worker (or a restart) follows the record, even if its own reads would differ.
    (out / train[9]["media"][0]["uri"]).write_bytes(b"")
    again = prompt_source(cfg, "train", model, tok, queue)
    assert [r["prompt"] for r in again.rows] == [r["prompt"] for r in source.rows]
    # Prompts start with one placeholder per media token, then the question.
    item = source.at(0, 1)[0]
    n = model.spec.tokens_for(item.row["media"][0]["kind"])
    assert item.prompt_ids[:n] == [model.media_token_id] * n
    assert model.media_token_id not in item.prompt_ids[n:]
    assert item.media[0].kind == item.row["media"][0]["kind"]


def test_a_text_policy_refuses_a_dataset_with_media(omni_run):
    cfg, _, _, _ = omni_run
    text = replace(cfg, model={"kind": "tiny-qwen3"})
    with pytest.raises(ValueError, match="rows with media, but model.kind 'tiny-qwen3'"):
        prompt_source(text, "train", torch.nn.Linear(1, 1), None)


def test_rows_carry_media_by_reference_and_the_trainer_rebuilds_the_same_inputs(omni_run, tmp_path):
    cfg, policy_dir, _, _ = omni_run
    model, tok = load_policy(policy_dir)
    source = prompt_source(cfg, "train", model, tok, TransferQueue(str(tmp_path / "q"), "r"))
    engine = TorchEngine(model, tok.eos_token_id, tok.pad_token_id, seed=0)
    items = source.at(0, 6)
    rows, metrics = rollout_groups(
        engine, tok, items, SamplingParams(max_new_tokens=2), 2, build_reward(cfg.reward)
    )
    table = rows_to_table(rows)
    # References only: kind and an absolute uri, no decoded tensors or inline bytes.
    media = table.column("media").to_pylist()
    assert all(m[0]["uri"].startswith("/") and m[0]["bytes"] is None for m in media)
    kinds = {item.row["media"][0]["kind"] for item in items}
    assert {k for k in metrics if k.startswith("train/accuracy/")} == {
        f"train/accuracy/{kind}" for kind in kinds
    }
    # The trainer's log-probs from the rows' references equal the engine's from the prompts.
    resolver = resolver_for(cfg, model)
    ((idx, mb),) = table_micro_batches(table, tok.pad_token_id, 1 << 20, resolver=resolver)
    logprobs, _ = response_logprobs(model, mb, 1.0)
    for j, i in enumerate(idx):
        n = len(rows[i]["response_ids"])
        engine_lp = torch.tensor(rows[i]["rollout_logprobs"])
        assert torch.allclose(logprobs[j, :n], engine_lp, atol=1e-5)


def test_relative_media_paths_resolve_against_the_dataset_folder(omni_run):
    _, _, out, train = omni_run
    rows = load_prompts(str(out / "train.jsonl"))
    assert rows[0]["media"][0]["uri"] == os.path.join(str(out), train[0]["media"][0]["uri"])
