"""Routing replay (R3) end to end: an MoE colocate run whose queue rows carry the experts the
engine routed each token to, and the SGLang client reading them from a server speaking SGLang's
API (fake_sglang.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from relax_core.config import load_config
from relax_core.queue import TransferQueue, table_to_rows
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine, SGLangError
from relax_core.run.lifecycle import run
from relax_core.train.checkpoint import find_resume_checkpoint, read_state
from tests.integration.fake_sglang import FakeSGLang, serve
from tests.s3servers import free_ports

pytestmark = pytest.mark.integration

MOE = {"num_experts": 4, "experts_per_token": 2}


def _check_experts(rows, layers: int) -> None:
    top_k = MOE["experts_per_token"]
    for row in rows:
        experts = row["routed_experts"]
        assert len(experts) == len(row["prompt_ids"]) + len(row["response_ids"]) - 1
        assert all(len(e) == layers * top_k for e in experts)
        assert all(0 <= x < MOE["num_experts"] for e in experts for x in e)


def test_moe_colocate_run_with_routing_replay_fills_routed_experts(small_config):
    cfg = load_config(
        small_config(
            model=MOE,
            train={"total_steps": 2, "steps_per_node": 2, "routing_replay": True},
        )
    )
    summary = run(cfg)
    queue = TransferQueue(cfg.queue.root, summary["run_id"])
    seqs = queue.committed("ready")
    assert len(seqs) == 2  # both steps trained
    rows = [r for s in seqs for r in table_to_rows(queue.read("ready", s))]
    _check_experts(rows, cfg.model.num_layers)


@pytest.mark.slow
def test_async_roles_record_and_replay_routed_experts(small_config, workdir):
    """Rollout engine, actor_fwd and trainer in their own processes, each with R3 attached."""
    path = small_config(
        "async.yaml",
        run_name="r3async",
        mode="async",
        model=MOE,
        rollout={"max_staleness": 1},
        train={"total_steps": 3, "checkpoint_every": 3, "routing_replay": True},
        services={"trainer_threads": 1, "poll_s": 0.002, "heartbeat_s": 0.2, "actor_fwd": True},
    )
    proc = subprocess.run(
        [sys.executable, "-m", "relax_core.entrypoints.run", "--cfg", path],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ckpt = find_resume_checkpoint(str(workdir / ".relax" / "checkpoints"), "r3async")
    queue = TransferQueue(".relax/queue", read_state(ckpt)["run_id"])
    rows = [r for s in queue.committed("ready") for r in table_to_rows(queue.read("ready", s))]
    assert rows and all(r["old_logprobs"] is not None for r in rows)
    _check_experts(rows, load_config(path).model.num_layers)


@pytest.fixture
def moe_sglang():
    from relax_core.config import ModelConfig
    from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3

    tok = build_char_tokenizer()
    shape = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
    model = build_tiny_qwen3(ModelConfig(**shape, **MOE), len(tok), seed=0)
    dense = build_tiny_qwen3(ModelConfig(**shape), len(tok), seed=0)
    servers = []
    for m in (model, dense):
        server = serve(FakeSGLang(m, tok.eos_token_id, tok.pad_token_id, 0.0), free_ports(1)[0])
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        yield [SGLangClient(f"http://127.0.0.1:{s.server_port}") for s in servers], tok
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_sglang_client_reads_routed_experts_from_an_sglang_api(moe_sglang):
    (moe, dense), tok = moe_sglang
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ["1+2=", "40+2=", "x"]]
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    outs = SGLangEngine(moe, routed_experts=True).generate(prompts, params)
    for c, p in zip(outs, prompts, strict=True):
        assert len(c.routed_experts) == len(p) + len(c.response_ids) - 1
        assert all(len(e) == 2 * MOE["experts_per_token"] for e in c.routed_experts)
    # A server with nothing to return refuses the field, and the client says which server.
    with pytest.raises(SGLangError, match="return_routed_experts"):
        SGLangEngine(dense, routed_experts=True).generate(prompts, params)
    assert SGLangEngine(dense).generate(prompts, params)[0].routed_experts is None
