"""What SGLang 0.5.23 does that a client on its happy path never sees, against 17 stand-in servers
(fake_sglang_fleet.py: one start, a process per server).

What a user would notice: an update reaches more servers than the sender has threads; a server
restarted at its URL takes the next update instead of crashing the trainer; an abort pause never
yields a cut sample; no request is served KV of older weights; a paused server is not reported
dead; a prompt that cannot fit is refused naming the setting; a long generation is not cut by
the client's socket timeout; no call lands on an endpoint SGLang deprecates.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine, SGLangError
from relax_core.sync.buckets import specs_of
from relax_core.sync.sglang import SGLangSender
from tests.integration.test_sglang_contract import ROOT
from tests.integration.weight_sync_actors import tiny_policy
from tests.runs import wait_until
from tests.s3servers import free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SERVERS = 17
"""One more than the weight sender's threads before they were sized to the servers."""


@pytest.fixture(scope="module")
def fleet():
    ports = free_ports(SERVERS)
    cmd = [sys.executable, "-m", "tests.integration.fake_sglang", "--port", str(ports[0])]
    cmd += ["--more-ports", *map(str, ports[1:]), "--step-delay-s", "0.05"]
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
    try:
        clients = [SGLangClient(f"http://127.0.0.1:{p}", timeout_s=60) for p in ports]
        for client in clients:
            wait_until(lambda c=client: _ready(c, proc), "the stand-in servers are up", 120)
        yield clients
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _ready(client: SGLangClient, proc: subprocess.Popen | None = None) -> bool:
    """GET /ready answers 200 (SGLang's cheap readiness: warmed up, not paused)."""
    assert proc is None or proc.poll() is None, "the stand-in servers exited"
    try:
        client.get("/ready", timeout_s=5)
        return True
    except SGLangError:
        return False


def _events(client: SGLangClient, since: int = 0) -> list[list]:
    return client.get("/relax_test/events")[since:]


def _kinds(client: SGLangClient, since: int = 0) -> list[str]:
    return [e[1] for e in _events(client, since)]


def _sender(clients: list[SGLangClient], mode: str = "retract") -> tuple[SGLangSender, list]:
    model, _ = tiny_policy(1)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    engines = [(f"e{i}", c.url) for i, c in enumerate(clients)]
    return SGLangSender(engines, specs_of(named), timeout_s=60, pause_mode=mode), named


def _served(client: SGLangClient) -> str:
    return client.get("/model_info")["weight_version"]


def test_an_update_reaches_more_servers_than_the_sender_has_threads(fleet):
    marks = [len(_events(c)) for c in fleet]
    sender, named = _sender(fleet)
    try:
        sender.push(named, 1)
        assert [_served(c) for c in fleet] == ["1"] * SERVERS
    finally:
        sender.destroy()
    # Forming the group and updating asked no endpoint SGLang deprecates.
    assert all("deprecated" not in _kinds(c, m) for c, m in zip(fleet, marks, strict=True))


def test_a_server_restarted_at_its_url_is_taken_back_into_the_group(fleet):
    a, b = fleet[0], fleet[1]
    sender, named = _sender([a, b])
    try:
        sender.push(named, 2)
        old = b.get("/relax_test/pid")
        os.kill(old, signal.SIGKILL)  # its kubelet starts it again at the same address
        wait_until(lambda: _pid(b) not in (None, old), "the server came back at its URL")
        wait_until(lambda: _ready(b), "the restarted server is up")
        assert _served(b) == "default"  # its launch weights, no weight group
        assert sender.push(named, 3) is True  # a new group, with the restarted server in it
        assert [_served(a), _served(b)] == ["3", "3"]
    finally:
        sender.destroy()


def _pid(client: SGLangClient) -> int | None:
    try:
        return client.get("/relax_test/pid", timeout_s=5)
    except SGLangError:
        return None


def test_an_abort_pause_never_yields_a_cut_sample(fleet):
    client = fleet[2]
    engine = SGLangEngine(client, pause_mode="abort")
    since = len(_events(client))
    done: dict = {}

    def generate() -> None:
        try:
            # Greedy: the tests' policies answer this prompt with 24 tokens, none ends early.
            done["out"] = engine.generate([[1, 5, 6, 7]] * 4, SamplingParams(24, greedy=True))
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            done["error"] = err

    worker = threading.Thread(target=generate)
    worker.start()
    wait_until(lambda: "generate_start" in _kinds(client, since), "generation started")
    client.post_ok("/pause_generation", {"mode": "abort"})
    client.post_ok("/continue_generation", {})
    worker.join(60)
    assert "out" in done, done
    kinds = _kinds(client, since)
    assert "abort" in kinds, "the pause cut no request: generation ended first"
    # SGLang answered the cut requests with their partial tokens; none comes back as a sample:
    # each was asked for again, after the pause.
    assert kinds.count("generate_start") == 2 and engine.aborted_retries == 4
    assert [(c.finish_reason, len(c.response_ids)) for c in done["out"]] == [("length", 24)] * 4


def test_no_request_is_served_kv_of_older_weights_after_an_in_place_update(fleet):
    client = fleet[3]
    engine = SGLangEngine(client)
    prompts, params = [[1, 5, 6, 7, 8, 9]] * 2, SamplingParams(4)
    sender, named = _sender([client], mode="in_place")
    try:
        engine.generate(prompts, params)  # the prefix cache now holds the launch weights' KV
        since = len(_events(client))
        sender.push(named, 4)
        engine.generate(prompts, params)
        assert "stale_kv" not in _kinds(client, since), str([e[1:] for e in _events(client, since)])
        # An update while a request runs: it goes on (in place), and the cache it leaves is
        # flushed before another request is served from it.
        since = len(_events(client))
        worker = threading.Thread(
            target=engine.generate, args=([[1, 5, 6]] * 2, SamplingParams(16))
        )
        worker.start()
        wait_until(lambda: "generate_start" in _kinds(client, since), "generation started")
        sender.push(named, 5)
        worker.join(60)
        wait_until(lambda: "flush" in _kinds(client, since), "the cache was flushed")
        engine.generate([[1, 5, 6]] * 2, params)
        assert "stale_kv" not in _kinds(client, since), str([e[1:] for e in _events(client, since)])
    finally:
        sender.destroy()


def test_a_paused_server_is_alive_and_waits_use_the_cheap_readiness(fleet):
    client = fleet[4]
    engine = SGLangEngine(client)
    since = len(_events(client))
    client.post_ok("/pause_generation", {"mode": "in_place"})
    try:
        assert engine.health()["alive"] is True  # paused for an update is not dead
        with pytest.raises(SGLangError, match="HTTP 503"):
            client.get("/ready")
    finally:
        client.post_ok("/continue_generation", {})
    assert engine.health() == {
        "alive": True,
        "url": client.url,
        "policy_version": engine.refresh_version(),
    }
    assert engine.parallel_shape() == (1, 1)
    assert "deprecated" not in _kinds(client, since)


def test_a_prompt_that_cannot_fit_is_refused_naming_the_setting(fleet):
    client = fleet[5]
    since = len(_events(client))
    long = list(range(1, 60)) * 8  # 472 tokens; the policy's context is 512
    with pytest.raises(SGLangError, match="maximum context length of 512 tokens"):
        client.post(
            "/generate", {"input_ids": [[1, 2], long], "sampling_params": {"max_new_tokens": 64}}
        )
    # The engine knows the context (the rollout worker reads it from the policy it serves) and
    # refuses before sending; one that does not passes on the server's refusal with the setting.
    for engine in (SGLangEngine(client, context_len=512), SGLangEngine(client)):
        with pytest.raises(SGLangError, match=r"rollout\.max_new_tokens 64.*512"):
            engine.generate([[1, 2], long], SamplingParams(64))
    assert "generate_start" not in _kinds(client, since)  # the whole batch was refused


def test_a_long_generation_is_not_cut_by_the_socket_timeout(fleet):
    engine = SGLangEngine(SGLangClient(fleet[6].url, timeout_s=0.5))
    out = engine.generate([[1, 5, 6, 7]] * 8, SamplingParams(40))  # >= 2 s of decode steps
    assert len(out) == 8 and max(len(c.response_ids) for c in out) > 20
