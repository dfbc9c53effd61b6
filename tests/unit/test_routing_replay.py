"""Rollout routing replay (R3) on a tiny Qwen3-MoE policy: the trainer routes each token to the
experts the rollout engine chose, and everything else about the model stays as it was."""

from __future__ import annotations

import base64
import copy

import numpy as np
import pyarrow as pa
import pytest
import torch

from relax_core.config import ConfigError, ModelConfig, config_from_dict
from relax_core.models.routing_replay import attach_routing_replay, routing_of
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.queue import rows_to_table
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.sglang_engine import SGLangEngine, SGLangError
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.batching import table_micro_batches
from relax_core.train.torch_backend import TorchBackend, response_logprobs

MOE = ModelConfig(
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    num_experts=4,
    experts_per_token=2,
)
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _prompts(tok):
    texts = ["1+2=", "40+2=", "7*8=", "x", "123+456="]
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _greedy_rollout(tok):
    """(policy with R3, prompts, greedy completions of a copy of it that recorded experts)."""
    model = build_tiny_qwen3(MOE, len(tok), seed=0)
    attach_routing_replay(model)
    engine = TorchEngine(copy.deepcopy(model), tok.eos_token_id, tok.pad_token_id, seed=1)
    prompts = _prompts(tok)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, greedy=True))
    return model, prompts, outs


def _mb(tok, prompts, outs, experts=None):
    return make_micro_batch(
        prompts,
        [c.response_ids for c in outs],
        [[1] * len(c.response_ids) for c in outs],
        tok.pad_token_id,
        routed_experts=[c.routed_experts for c in outs] if experts is None else experts,
    )


def test_off_mode_is_the_plain_model_bit_for_bit(tok):
    plain = build_tiny_qwen3(MOE, len(tok), seed=0)
    wrapped = copy.deepcopy(plain)
    attach_routing_replay(wrapped)
    # Same parameter names and tensors (checkpoints, weight sync), same outputs.
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert wrapped.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([p + [5] * (8 - len(p)) for p in _prompts(tok)])
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=ids).logits, plain(input_ids=ids).logits)
    params = SamplingParams(max_new_tokens=5, temperature=0.9)
    outs = [
        TorchEngine(m, tok.eos_token_id, tok.pad_token_id, seed=7).generate(_prompts(tok), params)
        for m in (plain, wrapped)
    ]
    assert [c.logprobs for c in outs[0]] == [c.logprobs for c in outs[1]]
    assert outs[0][0].routed_experts is None  # the plain policy records nothing
    # A weight update reaches the router the wrapper holds.
    engine = TorchEngine(wrapped, tok.eos_token_id, tok.pad_token_id)
    engine.update_weights([("model.layers.0.mlp.gate.weight", torch.zeros(4, 32))], 1)
    assert routing_of(wrapped).routers[0].router.weight.abs().sum() == 0


def test_attaching_to_a_dense_policy_names_its_class(tok):
    dense = build_tiny_qwen3(ModelConfig(hidden_size=32, num_layers=1), len(tok), seed=0)
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        attach_routing_replay(dense)


def test_generation_records_every_token_but_the_last(tok):
    _, prompts, outs = _greedy_rollout(tok)
    for p, c in zip(prompts, outs, strict=True):
        assert len(c.routed_experts) == len(p) + len(c.response_ids) - 1
        assert all(len(e) == LAYERS * TOP_K for e in c.routed_experts)
        for token in c.routed_experts:  # top-k: distinct experts per layer
            for layer in range(LAYERS):
                chosen = token[layer * TOP_K : (layer + 1) * TOP_K]
                assert len(set(chosen)) == TOP_K and all(0 <= e < 4 for e in chosen)


def test_replay_routes_as_generation_did_and_scores_the_same(tok):
    model, prompts, outs = _greedy_rollout(tok)
    mb = _mb(tok, prompts, outs)
    backend = TorchBackend(model, lr=1e-3)
    with routing_of(model).capture() as used:
        (logp,) = backend.logprobs([mb])
    used = used.tokens(len(prompts))  # [B, S, L, K]: what the training forward routed to
    for i, (p, c) in enumerate(zip(prompts, outs, strict=True)):
        recorded = torch.tensor(c.routed_experts).view(-1, LAYERS, TOP_K)
        n = len(p) + len(c.response_ids) - 1
        for layer in range(LAYERS):
            assert torch.equal(used[i, :n, layer], recorded[:, layer]), (i, layer)
        # The training forward (no KV cache, right padding) scores what generation scored.
        assert logp[i, : len(c.logprobs)].tolist() == pytest.approx(c.logprobs, abs=1e-5)


def test_replay_of_other_experts_changes_the_logprobs(tok):
    model, prompts, outs = _greedy_rollout(tok)
    backend = TorchBackend(model, lr=1e-3)
    (same,) = backend.logprobs([_mb(tok, prompts, outs)])
    # Every token's experts shifted by one: still valid, distinct experts, just not the router's.
    shifted = [[[(e + 1) % 4 for e in t] for t in c.routed_experts] for c in outs]
    (other,) = backend.logprobs([_mb(tok, prompts, outs, shifted)])
    mask = _mb(tok, prompts, outs).loss_mask.bool()
    assert (same - other)[mask].abs().max() > 1e-3


def test_gradients_reach_the_router_under_replay(tok):
    model, prompts, outs = _greedy_rollout(tok)
    mb = _mb(tok, prompts, outs)
    logp, _ = response_logprobs(model, mb, temperature=1.0)
    (logp * mb.loss_mask).sum().backward()
    for router in routing_of(model).routers:
        grad = router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_a_micro_batch_with_experts_needs_a_policy_with_replay(tok):
    _, prompts, outs = _greedy_rollout(tok)
    fresh = build_tiny_qwen3(MOE, len(tok), seed=0)
    with pytest.raises(ValueError, match="no routing replay attached"):
        response_logprobs(fresh, _mb(tok, prompts, outs), temperature=1.0)


def _rows(prompts, outs):
    return [
        {
            "uid": f"g-s{i}",
            "group_id": "g",
            "prompt_ids": p,
            "response_ids": c.response_ids,
            "loss_mask": [1] * len(c.response_ids),
            "rollout_logprobs": c.logprobs,
            "routed_experts": c.routed_experts,
        }
        for i, (p, c) in enumerate(zip(prompts, outs, strict=True))
    ]


def test_queue_rows_carry_the_experts_into_micro_batches(tok):
    _, prompts, outs = _greedy_rollout(tok)
    table = rows_to_table(_rows(prompts, outs))
    ((rows, mb),) = table_micro_batches(table, tok.pad_token_id, 1 << 20, routed_experts=True)
    assert mb.routed_experts.shape == (*mb.input_ids.shape, LAYERS * TOP_K)
    for j, i in enumerate(rows):
        n = len(outs[i].routed_experts)
        assert mb.routed_experts[j, :n].tolist() == outs[i].routed_experts
        assert (mb.routed_experts[j, n:] == 0).all()  # last token and padding: expert 0
    # Without routing replay the column is not read.
    ((_, plain),) = table_micro_batches(table, tok.pad_token_id, 1 << 20)
    assert plain.routed_experts is None


def test_a_row_without_experts_is_an_error_naming_it(tok):
    _, prompts, outs = _greedy_rollout(tok)
    rows = _rows(prompts, outs)
    rows[2]["routed_experts"] = None
    table = rows_to_table(rows)
    with pytest.raises(ValueError, match="'g-s2' has no routed_experts"):
        table_micro_batches(table, tok.pad_token_id, 1 << 20, routed_experts=True)
    rows[2]["routed_experts"] = outs[2].routed_experts[:-1]
    with pytest.raises(ValueError, match="'g-s2'"):
        table_micro_batches(rows_to_table(rows), tok.pad_token_id, 1 << 20, routed_experts=True)


# ---------------------------------------------------------------------------- SGLang client


class _Canned:
    """An SGLang client stand-in answering /generate with fixed results."""

    url = "http://sglang.test"
    timeout_s = 600.0

    def __init__(self, answers):
        self.answers, self.bodies = answers, []

    def post(self, path, body=None, timeout_s=None):
        self.bodies.append(body)
        return self.answers

    def get(self, path, timeout_s=None):
        assert path == "/server_info", path  # what the engine asks before it generates
        return {"context_length": 512, "tp_size": 1, "dp_size": 1}


def _sglang_answer(output_ids, experts: np.ndarray | None) -> dict:
    meta = {
        "finish_reason": {"type": "stop"},
        "output_token_logprobs": [[-0.5, t, None] for t in output_ids],
        "weight_version": "3",
    }
    if experts is not None:  # as SGLang's detokenizer encodes them: int32 .tobytes(), base64
        meta["routed_experts"] = base64.b64encode(experts.astype(np.int32).tobytes()).decode()
    return {"text": "", "output_ids": output_ids, "meta_info": meta}


def test_sglang_client_parses_routed_experts_in_sglangs_format():
    prompt, output = [5, 6, 7], [8, 9]
    experts = np.arange(4 * LAYERS * TOP_K).reshape(4, LAYERS, TOP_K) % 60  # 3 + 2 - 1 tokens
    client = _Canned([_sglang_answer(output, experts)])
    engine = SGLangEngine(client, routed_experts=True)
    (c,) = engine.generate([prompt], SamplingParams(max_new_tokens=2))
    assert client.bodies[0]["return_routed_experts"] is True
    assert c.routed_experts == experts.reshape(4, LAYERS * TOP_K).tolist()
    # Not asked for: not sent, not read.
    client = _Canned([_sglang_answer(output, None)])
    (c,) = SGLangEngine(client).generate([prompt], SamplingParams(max_new_tokens=2))
    assert "return_routed_experts" not in client.bodies[0] and c.routed_experts is None


def test_sglang_client_refuses_a_missing_or_misshapen_routed_experts():
    engine = SGLangEngine(_Canned([_sglang_answer([8, 9], None)]), routed_experts=True)
    with pytest.raises(SGLangError, match="routed_experts"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
    odd = np.zeros(7, dtype=np.int32)  # 7 ints for 4 tokens
    engine = SGLangEngine(_Canned([_sglang_answer([8, 9], odd)]), routed_experts=True)
    with pytest.raises(SGLangError, match="routed_experts"):
        engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))


# ---------------------------------------------------------------------------- config


def test_config_names_the_fields_of_an_impossible_moe():
    with pytest.raises(ConfigError, match=r"model\.experts_per_token: must be in \[1, "):
        config_from_dict({"model": {"num_experts": 4, "experts_per_token": 5}})
    config_from_dict({"model": {"num_experts": 4, "experts_per_token": 4}})
    # Routing replay on a dense policy: the message names both fields.
    with pytest.raises(ConfigError, match=r"train\.routing_replay: .*model\.num_experts"):
        config_from_dict({"train": {"routing_replay": True}})
    cfg = config_from_dict({"model": {"num_experts": 4}, "train": {"routing_replay": True}})
    assert cfg.train.routing_replay and cfg.model.num_experts == 4


def test_arrow_column_round_trips_experts(tok):
    _, prompts, outs = _greedy_rollout(tok)
    table = rows_to_table(_rows(prompts, outs))
    assert table.schema.field("routed_experts").type == pa.list_(pa.list_(pa.int32()))
    assert table.column("routed_experts").to_pylist()[0] == outs[0].routed_experts
