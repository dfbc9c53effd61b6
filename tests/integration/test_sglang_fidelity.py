"""The SGLang rules the stand-in copies from the pinned 0.5.23 source, each seen from the client.

Each test fails if the stand-in dropped the rule (it would hide the bug it exists to catch) or if
the client had the bug: a server warming up answers /health with 503 and the client waits; a
retracted request is run again under the new weights without failing; a server with TP ranks
gets each of them into the weight group at its own rank; a server with data-parallel replicas is
refused by name; a weight name SGLang's load_weights skips (transformers 5's fused MoE experts)
is caught, not silently left stale.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from relax_core.config import ModelConfig, SGLangConfig
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.server_client import wait_healthy
from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine, SGLangError
from relax_core.rollout.sglang_server import SGLangServer
from relax_core.sync.buckets import specs_of
from relax_core.sync.sglang import SGLangSender
from tests.integration.test_sglang_contract import ROOT, _digest, fake_servers
from tests.integration.weight_sync_actors import engine_prompts, tiny_policy
from tests.runs import wait_until
from tests.s3servers import free_ports

pytestmark = pytest.mark.integration
SHIM = f"{ROOT}/tests/integration/sglang_shim"


def _start(port: int, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.integration.fake_sglang", "--port", str(port), *args]
    return subprocess.Popen(cmd, cwd=ROOT)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code


def _first_http_answer(url: str, proc: subprocess.Popen) -> None:
    """A naive readiness wait: any HTTP answer means the server is up."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            _status(url)
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the server never answered")


class _HealthAnswers(SGLangClient):
    """A client that keeps what each `/health` poll got: 'ok' or the error."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.answers: list[str] = []

    def get(self, path: str, timeout_s: float | None = None):
        try:
            answer = super().get(path, timeout_s)
        except SGLangError as err:
            if path == "/health":
                self.answers.append(str(err))
            raise
        if path == "/health":
            self.answers.append("ok")
        return answer


@pytest.mark.slow
def test_a_server_warming_up_answers_503_and_the_client_waits_for_it(tmp_path, monkeypatch):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    warmed = tmp_path / "warm-up-ran"  # the server warms up until this file exists
    proc = _start(port, "--warmup-until", str(warmed))
    client = _HealthAnswers(url)
    waited: dict = {}

    def wait() -> None:
        try:
            wait_healthy(client, 120, proc)
            waited["ok"] = True
        except SGLangError as err:
            waited["error"] = err

    waiter = threading.Thread(target=wait, daemon=True)
    try:
        _first_http_answer(f"{url}/health", proc)
        # A client that took any answer as "up" would go on now, while SGLang says it is not.
        assert _status(f"{url}/health") == 503
        assert _status(f"{url}/health_generate") == 503
        waiter.start()
        wait_until(lambda: len(client.answers) >= 2, "wait_healthy polled /health twice")
        assert waiter.is_alive(), waited  # told 503 twice, it still waits
        assert all("HTTP 503" in a for a in client.answers), client.answers
        warmed.touch()
        waiter.join(60)
        assert waited == {"ok": True}, waited or "wait_healthy still waits, 60 s after warm-up"
        assert client.answers[-1] == "ok" and _status(f"{url}/health") == 200
    finally:
        warmed.touch()  # a waiter left by a failed assertion returns
        if waiter.is_alive():
            waiter.join(60)
        proc.kill()
        proc.wait()
    # The product path: a rollout worker's own server comes back only once it is up, and serves.
    monkeypatch.setenv("PYTHONPATH", f"{SHIM}:{ROOT}")
    monkeypatch.setenv("RELAX_TEST_SGLANG_WARMUP_S", "4")
    model, tok = tiny_policy(0)
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    cfg = SGLangConfig(start_timeout_s=120)
    server = SGLangServer.start(str(tmp_path / "policy"), cfg, 1, 3, str(tmp_path / "s.log"))
    try:
        assert _status(f"{server.client.url}/health") == 200
        engine = SGLangEngine(server.client)
        assert engine.refresh_version() == 3
        assert len(engine.generate([[1, 5, 6]], SamplingParams(3))[0].response_ids) <= 3
    finally:
        server.stop()


@pytest.fixture
def slow_server():
    """A server whose decode steps take 0.3 s, so an update lands mid-generation."""
    (port,) = free_ports(1)
    proc = _start(port, "--step-delay-s", "0.3")
    client = SGLangClient(f"http://127.0.0.1:{port}", timeout_s=120)
    try:
        wait_healthy(client, 120, proc, path="/ready")
        yield client
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_retracted_request_runs_again_under_the_new_weights_and_does_not_fail(slow_server):
    client = slow_server
    served, tok = tiny_policy(0)  # the server's policy
    trainer, _ = tiny_policy(5)
    named = list(trainer.named_parameters())
    sender = SGLangSender([("sg", client.url)], specs_of(named), timeout_s=60, pause_mode="retract")
    prompt = engine_prompts(tok)[0]
    answer: dict = {}
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0.0},
        "return_logprob": True,
    }
    worker = threading.Thread(target=lambda: answer.update(client.post("/generate", body)))
    try:
        sender.init()
        worker.start()
        # The update lands mid-generation: the request runs (the first of its 10 decode steps of
        # 0.3 s ends after this), so the pause retracts it at a step boundary.
        wait_until(
            lambda: any(e[1] == "generate_start" for e in client.get("/relax_test/events")),
            "the request started generating",
        )
        sender.push(named, 1)
        worker.join(60)
        assert not worker.is_alive(), "the retracted request did not finish within 60 s"
    finally:
        sender.destroy()
    meta, out = answer["meta_info"], answer["output_ids"]
    assert meta["num_retractions"] == 1 and meta["weight_version"] == "1"
    assert len(out) == 10 and meta["finish_reason"]["type"] == "length"
    (kept,) = [e[2] for e in client.get("/relax_test/events") if e[1] == "retract"]
    assert 0 < kept < len(out)
    # The tokens generated before the retraction stay; the rest are the new weights' greedy
    # choices given prompt + everything so far (the KV cache recomputed, not the old one).
    with torch.no_grad():
        for j, token in enumerate(out):
            model = served if j < kept else trainer
            logits = model(torch.tensor([prompt + out[:j]])).logits[0, -1]
            assert int(logits.argmax()) == token, (j, kept)


@pytest.fixture(scope="module")
def tp2_servers():
    with fake_servers(2, "--tp-size", "2") as clients:
        yield clients


@pytest.mark.slow
def test_two_servers_of_two_tp_ranks_each_join_at_their_own_ranks(tp2_servers):
    trainer, _ = tiny_policy(4)
    named = list(trainer.named_parameters())
    engines = [(f"sg-{i}", c.url) for i, c in enumerate(tp2_servers)]
    sender = SGLangSender(engines, specs_of(named), bucket_bytes=8 << 10, timeout_s=30)
    try:
        sender.push(named, 4)
        assert sender.rendezvous["world_size"] == 5  # the trainer + 2 servers x 2 ranks
        assert sender.rendezvous["rank_offsets"] == {"sg-0": 1, "sg-1": 3}
        for client in tp2_servers:  # every rank received the same bytes, or the load failed
            assert client.get("/relax_test/digest") == _digest(named)
            assert SGLangEngine(client).refresh_version() == 4
    finally:
        sender.destroy()


@pytest.fixture(scope="module")
def dp2_server():
    """One server with data-parallel replicas, for every refusal of them."""
    with fake_servers(1, "--dp-size", "2") as (client,):
        yield client


@pytest.mark.slow
def test_a_server_with_data_parallel_replicas_is_refused_by_name(dp2_server):
    url = dp2_server.url
    trainer, _ = tiny_policy(4)
    named = list(trainer.named_parameters())
    sender = SGLangSender([("sg-dp", url)], specs_of(named), timeout_s=30)
    try:
        # SGLang itself asserts dp_size == 1 in its tokenizer manager: an HTTP 500.
        group = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1}
        with pytest.raises(SGLangError, match="HTTP 500.*data-parallel"):
            SGLangClient(url).post("/init_weights_update_group", {**group, "world_size": 2})
        with pytest.raises(SGLangError, match="sg-dp .* runs 2 data-parallel replicas"):
            sender.push(named, 1)
    finally:
        sender.destroy()


@pytest.mark.slow
def test_tensor_updates_are_refused_by_a_server_with_data_parallel_replicas(dp2_server):
    with pytest.raises(SGLangError, match="HTTP 500.*data-parallel"):
        dp2_server.post_ok("/update_weights_from_tensor", {"serialized_named_tensors": ["AA=="]})


# ---------------------------------------------------------------------- MoE weight names
MOE = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1}
MOE_EXPERTS = {"intermediate_size": 64, "num_experts": 4, "experts_per_token": 2}


def _per_expert(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """transformers 5's fused expert tensors as the checkpoint's per-expert names."""
    out = []
    for name, t in named:
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out += [
                    (f"{prefix}{e}.gate_proj.weight", gate),
                    (f"{prefix}{e}.up_proj.weight", up),
                ]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            out += [(f"{prefix}{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        else:
            out.append((name, t))
    return out


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    tok = build_char_tokenizer()
    model = build_tiny_qwen3(ModelConfig(**MOE, **MOE_EXPERTS), len(tok), seed=0)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with fake_servers(1, "--checkpoint", str(path)) as (client,):
        yield client, len(tok)


def _push(client: SGLangClient, named: list, version: int) -> None:
    sender = SGLangSender([("moe", client.url)], specs_of(named), timeout_s=60)
    try:
        sender.push(named, version)
    finally:
        sender.destroy()


def _ignored(client: SGLangClient, named: list) -> list[str]:
    """The names sent that the server's load_weights did not consume."""
    consumed = set(client.get("/relax_test/loaded")["consumed"])
    return sorted(n for n, _ in named if n not in consumed)


@pytest.mark.slow
def test_sglang_loads_moe_experts_by_their_per_expert_names_only(moe_server):
    client, vocab = moe_server
    trainer = build_tiny_qwen3(ModelConfig(**MOE, **MOE_EXPERTS), vocab, seed=1)
    fused = [(n, p.detach()) for n, p in trainer.named_parameters()]
    # Fused names: the update succeeds, and SGLang silently keeps the old experts.
    _push(client, fused, 1)
    assert SGLangEngine(client).refresh_version() == 1
    assert _ignored(client, fused) == sorted(n for n, _ in fused if ".mlp.experts." in n)
    assert client.get("/relax_test/digest") != _digest(fused)
    # Per-expert checkpoint names: every one is consumed and the experts arrive.
    per_expert = _per_expert(fused)
    _push(client, per_expert, 2)
    assert _ignored(client, per_expert) == []
    assert client.get("/relax_test/digest") == _digest(fused)


def test_the_trainer_sends_an_moe_policy_in_names_sglang_loads(moe_server, tmp_path):
    """The trainer's own path: the torch backend's named_weights (transformers 5's fused
    experts), streamed through TrainerSync into the SGLang group make_sender builds."""
    from relax_core.pool.weights import TrainerSync, sglang_sender
    from relax_core.queue import TransferQueue
    from relax_core.train.torch_backend import TorchBackend

    client, vocab = moe_server
    backend = TorchBackend(build_tiny_qwen3(ModelConfig(**MOE, **MOE_EXPERTS), vocab, 2), lr=1e-3)
    specs = specs_of(backend.model.named_parameters())
    sender = sglang_sender(lambda: [("moe", client.url)], specs, timeout_s=60)
    sync = TrainerSync(None, sender, TransferQueue(str(tmp_path), "moe-run"))
    try:
        sync.push_or_reform(backend.named_weights, 3)
    finally:
        sync.destroy()
    assert SGLangEngine(client).refresh_version() == 3
    sent = _per_expert(list(backend.named_weights()))
    assert _ignored(client, sent) == []
    assert client.get("/relax_test/digest") == _digest(list(backend.named_weights()))
