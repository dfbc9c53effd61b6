"""Contract tests of the SGLang rollout client and weight sync, against a server speaking SGLang's
documented HTTP API (fake_sglang.py: real generation, a real gloo group joined as SGLang joins it).

What a user would notice: weights arrive bit-exact, the served version advances with each update,
no generation runs during an update, a new server joins the group, and a server that refuses or
is unreachable gives an error that names it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import torch

from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.server_client import wait_healthy
from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine, SGLangError
from relax_core.sync.buckets import specs_of
from relax_core.sync.process_group import leave_weight_group
from relax_core.sync.sglang import SGLangSender
from tests.integration.weight_sync_actors import engine_prompts, tiny_policy
from tests.runs import wait_until
from tests.s3servers import free_ports

# The module's stand-in servers take 15-20 s to start on 2 cores, and almost every test reads them.
pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(port: int, delay: float = 0.0, api_key: str = "") -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.fake_sglang",
            "--port",
            str(port),
            "--generate-delay-s",
            str(delay),
            *(["--api-key", api_key] if api_key else []),
        ],
        cwd=ROOT,
    )


@contextlib.contextmanager
def fake_servers(count: int, *args: str) -> Iterator[list[SGLangClient]]:
    """`count` stand-in servers started with `args`, healthy, then killed however the block
    ends."""
    ports = free_ports(count)
    procs = []
    try:
        for port in ports:
            cmd = [sys.executable, "-m", "tests.integration.fake_sglang", "--port", str(port)]
            procs.append(subprocess.Popen([*cmd, *args], cwd=ROOT))
        clients = [SGLangClient(f"http://127.0.0.1:{p}", timeout_s=120) for p in ports]
        for proc, client in zip(procs, clients, strict=True):
            wait_healthy(client, 120, proc, path="/ready")
        yield clients
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def servers():
    with fake_servers(2, "--generate-delay-s", "0.05") as clients:
        yield clients


def _digest(named) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
        for n, t in named
    }


def _events(client: SGLangClient) -> list[list]:
    return client.get("/relax_test/events")


def _generated_under(client: SGLangClient, version: int, since: int, failed: list) -> bool:
    """Whether a generate call ended under `version` after event `since` (or generating
    failed)."""
    ended = ["generate_end", str(version)]
    return bool(failed) or ended in [e[1:3] for e in _events(client)[since:]]


def test_generate_parses_sglang_answers(servers):
    model, tok = tiny_policy(0)
    engine = SGLangEngine(servers[0])
    prompts = engine_prompts(tok)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0))
    assert len(out) == len(prompts)
    for c in out:
        assert 1 <= len(c.response_ids) <= 6
        assert len(c.logprobs) == len(c.response_ids)
        assert all(lp <= 0.0 for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
    # Greedy is temperature 0 on the wire and gives the local model's arg-max continuation.
    greedy = engine.generate(prompts[:1], SamplingParams(max_new_tokens=5, greedy=True))[0]
    with torch.no_grad():
        ids = torch.tensor([prompts[0] + greedy.response_ids[:-1]])
        logits = model(ids).logits[0, len(prompts[0]) - 1 :]
    assert logits.argmax(-1).tolist() == greedy.response_ids
    assert engine.health()["alive"] is True


def test_updates_arrive_bit_exact_with_generation_paused(servers):
    client = servers[0]
    trainer, _ = tiny_policy(1)
    named = list(trainer.named_parameters())
    # Small buckets: several update calls per version, and the bucket plan has mixed sizes.
    sender = SGLangSender(
        [("sg-0", client.url)], specs_of(named), bucket_bytes=8 << 10, timeout_s=60
    )
    engine = SGLangEngine(client)
    stop = threading.Event()
    done: list = []
    failed: list[SGLangError] = []

    def hammer():
        prompts = engine_prompts(tiny_policy(0)[1])
        try:
            while not stop.is_set():
                done.extend(engine.generate(prompts, SamplingParams(max_new_tokens=4)))
        except SGLangError as err:  # the wait for generation below names it
            failed.append(err)

    worker = threading.Thread(target=hammer)
    worker.start()
    try:
        sender.init()
        for version in (1, 2):
            with torch.no_grad():
                for _, p in named:
                    p.add_(0.01 * version)
            started = len(_events(client))
            sender.push(named, version)
            assert client.get("/relax_test/digest") == _digest(named)
            # SGLang's load_weights consumed every name sent (it skips unknown ones silently).
            consumed = set(client.get("/relax_test/loaded")["consumed"])
            assert {n for n, _ in named} <= consumed
            assert SGLangEngine(client).refresh_version() == version
            events = _events(client)[started:]
            kinds = [e[1] for e in events]
            # pause before the first bucket, continue after the last, and between them no
            # generation starts or ends.
            first, last = (
                kinds.index("update_begin"),
                len(kinds) - 1 - kinds[::-1].index("update_end"),
            )
            assert "pause" in kinds[:first] and "continue" in kinds[last:]
            assert kinds.count("update_begin") == len(sender.buckets) > 1
            assert not {"generate_start", "generate_end"} & set(kinds[first : last + 1])
            # Generation runs under this version before the next update.
            wait_until(
                functools.partial(_generated_under, client, version, started, failed),
                f"a generate call ended under version {version}",
                every_s=0.02,
            )
            assert not failed, failed
    finally:
        stop.set()
        worker.join(60)
        sender.destroy()
    versions = {c.policy_version for c in done}
    assert {1, 2} <= versions | {c.policy_version_max for c in done}


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_update_while_requests_run_succeeds_in_each_pause_mode(servers, mode):
    client = servers[1]
    trainer, _ = tiny_policy(3)
    named = list(trainer.named_parameters())
    sender = SGLangSender(
        [("sg-1", client.url)], specs_of(named), bucket_bytes=1 << 20, timeout_s=60, pause_mode=mode
    )
    engine = SGLangEngine(client)
    prompts = engine_prompts(tiny_policy(0)[1])
    results: list = []
    worker = threading.Thread(
        target=lambda: results.extend(engine.generate(prompts, SamplingParams(max_new_tokens=8)))
    )
    try:
        sender.init()
        started = len(_events(client))
        worker.start()
        wait_until(
            lambda: "generate_start" in [e[1] for e in _events(client)[started:]],
            "generation started",
            every_s=0.02,
        )
        # An update arrives while a request runs: retract takes it out of the batch and the
        # cache is flushed; in_place keeps it running, so no flush may be asked for.
        sender.push(named, 30)
        assert SGLangEngine(client).refresh_version() == 30
        worker.join(60)
        assert len(results) == len(prompts)
    finally:
        sender.destroy()


def test_group_forms_again_when_a_server_joins(servers):
    trainer, _ = tiny_policy(2)
    named = list(trainer.named_parameters())
    wanted = [("sg-0", servers[0].url)]
    sender = SGLangSender(lambda: wanted, specs_of(named), bucket_bytes=1 << 20, timeout_s=60)
    try:
        assert sender.push(named, 10) is True  # formed at the first push
        assert sender.push(named, 11) is False
        wanted.append(("sg-1", servers[1].url))
        assert sender.needs_reform()
        assert sender.push(named, 12) is True
        assert sender.group_name.endswith("-1")
        for client in servers:
            assert client.get("/relax_test/digest") == _digest(named)
            assert SGLangEngine(client).refresh_version() == 12
        wanted.pop(0)  # sg-0 drained: the group goes on without it
        assert sender.push(named, 13) is True
        assert SGLangEngine(servers[1]).refresh_version() == 13
        assert SGLangEngine(servers[0]).refresh_version() == 12
    finally:
        sender.destroy()


def test_a_restarted_trainer_forms_a_new_group_with_servers_that_hold_the_dead_ones(servers):
    trainer, _ = tiny_policy(2)
    named = list(trainer.named_parameters())
    wanted = [("sg-0", servers[0].url)]
    dead = SGLangSender(lambda: wanted, specs_of(named), bucket_bytes=1 << 20, timeout_s=60)
    assert dead.push(named, 20) is True
    # The trainer dies: it never destroys its group, the server still holds it. Its successor
    # (a new process from the newest checkpoint) reads what the dead one recorded.
    record = dict(dead.rendezvous)
    restarted = SGLangSender(
        lambda: wanted, specs_of(named), bucket_bytes=1 << 20, timeout_s=60, previous=record
    )
    try:
        assert restarted.push(named, 21) is True
        assert restarted.group_name != record["group_name"]
        assert SGLangEngine(servers[0]).refresh_version() == 21
        assert servers[0].get("/relax_test/digest") == _digest(named)
        # The dead trainer's group is gone from the server: only the new one is held.
        with pytest.raises(SGLangError, match="HTTP 400.*does not exist"):
            servers[0].post(
                "/destroy_weights_update_group", {"group_name": record["group_name"]}, 30.0
            )
    finally:
        restarted.destroy()
        leave_weight_group(dead.group)


def test_refusals_and_unreachable_servers_are_named(servers):
    with pytest.raises(SGLangError, match=r"HTTP 400.*unknown field"):
        servers[0].post_ok("/pause_generation", {"mode": "abort", "bogus": 1})
    update = {"names": [], "dtypes": [], "shapes": [], "group_name": "nope"}
    # SGLang loads distributed updates only inside a weight-update session.
    with pytest.raises(SGLangError, match="HTTP 400.*must run between begin_weight_update"):
        servers[0].post_ok("/update_weights_from_distributed", update)
    servers[0].post_ok("/begin_weight_update", {})
    try:
        with pytest.raises(SGLangError, match="HTTP 400.*Group nope not in"):
            servers[0].post_ok("/update_weights_from_distributed", update)
    finally:
        servers[0].post_ok("/end_weight_update", {})
    (port,) = free_ports(1)
    dead = SGLangEngine(SGLangClient(f"http://127.0.0.1:{port}", timeout_s=5))
    with pytest.raises(SGLangError, match=f"127.0.0.1:{port}/generate: server unreachable"):
        dead.generate([[1, 2]], SamplingParams(max_new_tokens=2))
    assert dead.health()["alive"] is False
    with pytest.raises(ValueError, match="must start with http"):
        SGLangClient("localhost:30000")
    with pytest.raises(NotImplementedError, match="update_weights_from_distributed"):
        SGLangEngine(servers[0]).update_weights([], 1)


def test_a_server_with_an_api_key_serves_the_run_s_clients_only(monkeypatch):
    # The rollout pod's sidecar runs with --api-key from the run's secret; the rollout service
    # and the trainer read it from $RELAX_SGLANG_API_KEY.
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    proc = _start(port, api_key="run-key")
    monkeypatch.delenv("RELAX_SGLANG_API_KEY", raising=False)
    trainer, _ = tiny_policy(3)
    named = list(trainer.named_parameters())
    try:
        wait_healthy(SGLangClient(url), 120, proc, path="/ready")  # no key: the kubelet's probe
        outsider = SGLangEngine(SGLangClient(url))
        with pytest.raises(SGLangError, match=f"{url}/generate: HTTP 401"):
            outsider.generate([[1, 2]], SamplingParams(max_new_tokens=2))
        stranger = SGLangSender([("sg-0", url)], specs_of(named), timeout_s=30)
        with pytest.raises(SGLangError, match="HTTP 401"):
            stranger.push(named, 1)  # nobody else can make it join a weight group
        stranger.destroy()
        monkeypatch.setenv("RELAX_SGLANG_API_KEY", "run-key")
        engine = SGLangEngine(SGLangClient(url))
        assert len(engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))) == 1
        sender = SGLangSender([("sg-0", url)], specs_of(named), timeout_s=60)
        try:
            sender.push(named, 7)
        finally:
            sender.destroy()
        assert engine.refresh_version() == 7
        assert SGLangClient(url).get("/relax_test/digest") == _digest(named)
    finally:
        proc.kill()
        proc.wait()
