"""A LoRA policy on SGLang servers (SGLang 0.5.23's LoRA API), against the stand-in
(fake_sglang_lora.py: adapters loaded by name, applied per request to a real torch model).

What a user would notice: after a sync the server samples what the trainer's LoRA policy
computes, under the version it reports; each version is its own adapter and the old ones go;
a request whose adapter went meanwhile is sent again instead of failing; whole runs (async and
colocate) sample with the adapter of the version every row records; and the stand-in refuses
what SGLang refuses, so a client mistake shows here and not first on a GPU.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
import torch

from relax_core.models.lora import adapter_weights, attach_lora
from relax_core.rollout.engine import SamplingParams
from relax_core.rollout.sglang_engine import SGLangClient, SGLangEngine, SGLangError
from relax_core.rollout.sglang_lora import (
    load_adapter,
    lora_flags,
    peft_config,
    peft_tensors,
    tensor_payloads,
    unload_adapter,
)
from relax_core.rollout.sglang_server import server_command
from relax_core.sync.buckets import specs_of
from relax_core.sync.sglang_lora import SGLangLoRASender
from tests.integration.test_sglang_contract import ROOT, fake_servers
from tests.integration.test_sglang_engine_run import SERVICES, SHIM, _run
from tests.integration.weight_sync_actors import engine_prompts, tiny_policy
from tests.runs import wait_until

pytestmark = pytest.mark.integration

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = ("--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", *MODULES)


@pytest.fixture
def launches(monkeypatch, workdir):
    """Child processes launch the stand-in as `sglang.launch_server`; its argv are recorded."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([SHIM, ROOT, os.environ.get("PYTHONPATH", "")])
    )
    record = workdir / "sglang-argv.jsonl"
    monkeypatch.setenv("RELAX_TEST_SGLANG_ARGV", str(record))
    return record


@pytest.fixture(scope="module")
def lora_server():
    """A server with two TP ranks serving adapters of rank <= 8 on every projection."""
    with fake_servers(1, *LORA, "--max-loras-per-batch", "3", "--tp-size", "2") as (client,):
        yield client


def lora_policy(seed: int, rank: int = 4, modules: str = ",".join(MODULES)):
    """The stand-ins' base (tiny_policy(0)) with an adapter whose B is not zero (a trained
    one: a fresh adapter leaves the base as it is)."""
    model, tok = tiny_policy(0)
    attach_lora(model, rank, 8.0, 0.0, modules, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model.eval(), tok


def adapter_of(model) -> list[tuple[str, torch.Tensor]]:
    return list(adapter_weights(model))


def sampled_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response token | prefix) under `model` at temperature 1 (what the engine reports)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1)


def worst_gap(model, prompts, completions) -> float:
    return max(
        (sampled_logprobs(model, p, c.response_ids) - torch.tensor(c.logprobs)).abs().max().item()
        for p, c in zip(prompts, completions, strict=True)
    )


def _load_raw(client: SGLangClient, name: str, tensors: dict, config: dict, tp: int = 2):
    body = {
        "lora_name": name,
        "config_dict": config,
        "serialized_named_tensors": tensor_payloads(tensors, tp),
    }
    return client.post("/load_lora_adapter_from_tensors", body)


def _refused(call, status: int, text: str) -> None:
    with pytest.raises(SGLangError) as err:
        call()
    assert f"HTTP {status}" in str(err.value) and text in str(err.value), str(err.value)


def _events_of(client: SGLangClient) -> list[list]:
    return client.get("/relax_test/events")


def _held(client: SGLangClient) -> list[str]:
    return [c["id"] for c in client.get("/v1/models")["data"] if c.get("parent")]


# ---------------------------------------------------------------------------------- the stand-in
@pytest.mark.slow
def test_a_server_without_enable_lora_refuses_adapters(tmp_path):
    model, tok = lora_policy(1)
    tensors = peft_tensors(adapter_of(model))
    config = peft_config({n: tuple(t.shape) for n, t in tensors.items()}, 8.0)
    with fake_servers(1) as (plain,):
        _refused(lambda: _load_raw(plain, "policy-v1", tensors, config, 1), 400, "not enabled")
        _refused(lambda: unload_adapter(plain, "policy-v1"), 400, "not enabled")
        body = {"input_ids": [1, 5], "sampling_params": {"max_new_tokens": 2}, "lora_path": "a"}
        _refused(lambda: plain.post("/generate", body), 400, "but LoRA is not enabled")
        assert _held(plain) == []
    # SGLang asserts at launch: --enable-lora without --lora-paths needs a rank and modules.
    out = subprocess.run(
        [sys.executable, "-m", "tests.integration.fake_sglang", "--port", "1", "--enable-lora"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "--max-lora-rank and --lora-target-modules" in out.stderr


@pytest.mark.slow
def test_the_stand_in_refuses_adapters_as_sglang_does(lora_server):
    client = lora_server
    model, tok = lora_policy(1)
    tensors = peft_tensors(adapter_of(model))
    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    config = peft_config(shapes, 8.0)
    answer = _load_raw(client, "adapter-a", tensors, config)
    assert answer["success"] is True and answer["loaded_adapters"]["adapter-a"] == "__tensor__"
    assert set(answer) == {"rid", "http_worker_ipc", "success", "error_message", "loaded_adapters"}
    # A name is loaded once.
    _refused(lambda: _load_raw(client, "adapter-a", tensors, config), 400, "already loaded")
    # A rank above --max-lora-rank, a module outside --lora-target-modules.
    big, _ = lora_policy(2, rank=16)
    big_tensors = peft_tensors(adapter_of(big))
    big_config = peft_config({n: tuple(t.shape) for n, t in big_tensors.items()}, 8.0)
    _refused(lambda: _load_raw(client, "b", big_tensors, big_config), 400, "with rank 16 is incomp")
    wider = {**config, "target_modules": [*MODULES, "lm_head"]}
    _refused(lambda: _load_raw(client, "b", tensors, wider), 400, "`--lora-target-modules`")
    # What LoRAConfig and LoRAAdapter refuse: no rank, not LoRA, q_proj without v_proj, DoRA.
    no_r = {k: v for k, v in config.items() if k != "r"}
    _refused(lambda: _load_raw(client, "b", tensors, no_r), 400, "'r'")
    _refused(lambda: _load_raw(client, "b", tensors, {**config, "peft_type": "IA3"}), 400, "")
    _refused(lambda: _load_raw(client, "b", tensors, {**config, "use_dora": True}), 400, "DoRA")
    no_v = {n: t for n, t in tensors.items() if ".v_proj." not in n}
    _refused(lambda: _load_raw(client, "b", no_v, config), 400, "v_proj.lora_A.weight'")
    # The payloads: one per TP rank, each a {name: tensor} dict of allowed globals.
    _refused(lambda: _load_raw(client, "b", tensors, config, tp=1), 500, "1 payloads for 2")
    as_list = base64.b64encode(pickle.dumps(list(tensors.items()))).decode()
    body = {"lora_name": "b", "config_dict": config, "serialized_named_tensors": [as_list] * 2}
    _refused(lambda: client.post("/load_lora_adapter_from_tensors", body), 500, "items")
    evil = base64.b64encode(pickle.dumps({"x": time.struct_time((0,) * 9)})).decode()
    body["serialized_named_tensors"] = [evil] * 2
    _refused(lambda: client.post("/load_lora_adapter_from_tensors", body), 500, "Blocked")
    # Requests: a name never loaded; one unloaded since (a tensor adapter is not reloaded).
    gen = {"input_ids": [[1, 5], [1, 6]], "sampling_params": {"max_new_tokens": 2}}
    _refused(lambda: client.post("/generate", {**gen, "lora_path": "zz"}), 400, "never been")
    _refused(lambda: client.post("/generate", {**gen, "lora_path": ["adapter-a"]}), 400, "match")
    assert len(client.post("/generate", {**gen, "lora_path": ["adapter-a", None]})) == 2
    unload_adapter(client, "adapter-a")
    _refused(lambda: client.post("/generate", {**gen, "lora_path": "adapter-a"}), 400, "implicit")
    _refused(lambda: unload_adapter(client, "adapter-a"), 400, "does not exist")
    # k_proj without q_proj loads, and matches no target at its first batch (in the scheduler).
    only_k = {n: t for n, t in tensors.items() if ".k_proj." in n}
    assert _load_raw(client, "only-k", only_k, {**config, "target_modules": ["k_proj"]})["success"]
    _refused(lambda: client.post("/generate", {**gen, "lora_path": "only-k"}), 500, "k_proj")
    unload_adapter(client, "only-k")
    assert _held(client) == []


# ---------------------------------------------------------------------------------- the client
def test_after_a_sync_the_server_samples_the_trainers_lora_policy(lora_server):
    client = lora_server
    prompts = engine_prompts(tiny_policy(0)[1])
    base, _ = tiny_policy(0)
    engine = SGLangEngine(client, lora=True)
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    keep = 2
    for version, seed in ((1, 11), (2, 12)):
        trainer, _ = lora_policy(seed)
        named = adapter_of(trainer)
        sender = SGLangLoRASender([("sg", client.url)], specs_of(named), 8.0, keep, 60)
        sender.push(named, version)
        assert engine.refresh_version() == version and engine.adapter == f"policy-v{version}"
        out = engine.generate(prompts, params)
        assert {c.policy_version for c in out} == {version}
        assert {c.policy_version_max for c in out} == {None}
        # The trainer's log-probs of what the server sampled, to float32 rounding; the base
        # alone (an adapter never applied) is far off, so this would catch it.
        assert worst_gap(trainer, prompts, out) < 2e-5
        assert worst_gap(base, prompts, out) > 1e-2
    events = client.get("/relax_test/events")
    assert [e[2] for e in events if e[1] == "lora_generate"][-1] == ["policy-v2"]
    for version in (3, 4):
        sender.push(named, version)
    # The newest `keep`: older ones are unloaded in the background (an unload waits for the
    # requests running with the adapter; the trainer does not).
    wait_until(lambda: _held(client) == ["policy-v3", "policy-v4"], "v1 and v2 unloaded")
    loads = sum(e[1] == "lora_load" for e in client.get("/relax_test/events"))
    sender.push(named, 4)  # the same version again (an engine joined): nothing to load
    assert sum(e[1] == "lora_load" for e in client.get("/relax_test/events")) == loads
    # A version held that is newer than the trainer's is a dead trainer's: it goes first.
    load_adapter(client, 9, peft_tensors(named), sender.config, 2)
    sender.push(named, 5)
    wait_until(lambda: _held(client) == ["policy-v4", "policy-v5"], "v3 and v9 unloaded")
    for name in _held(client):
        unload_adapter(client, name)


@pytest.mark.slow
def test_a_request_whose_adapter_was_unloaded_meanwhile_goes_again_with_the_newest():
    with fake_servers(1, *LORA, "--step-delay-s", "0.05") as (client,):
        trainer, tok = lora_policy(3)
        named = adapter_of(trainer)
        sender = SGLangLoRASender([("sg", client.url)], specs_of(named), 8.0, 1, 60)
        sender.push(named, 1)
        engine = SGLangEngine(client, lora=True)
        assert engine.refresh_version() == 1
        prompts = engine_prompts(tok)[:2]
        params = SamplingParams(max_new_tokens=6, temperature=1.0)
        # An update while a request runs with v1: v1's unload waits for it, which ends on v1.
        running: dict = {}
        other = SGLangEngine(client, lora=True)
        other.refresh_version()
        thread = threading.Thread(
            target=lambda: running.update(out=other.generate(prompts, params))
        )
        thread.start()
        deadline = time.monotonic() + 60
        while ["lora_generate", ["policy-v1"]] not in [e[1:] for e in _events_of(client)]:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
        # Held in place (an update of another kind), the request cannot end while the trainer
        # pushes v2: the push returns without waiting for v1's unload.
        client.post_ok("/pause_generation", {"mode": "in_place"})
        sender.push(named, 2)
        assert ["generate_end", "default"] not in [e[1:] for e in _events_of(client)]
        client.post_ok("/continue_generation", {})
        thread.join()
        wait_until(lambda: ["lora_unload", "policy-v1"] in [e[1:] for e in _events_of(client)],
                   "v1 was unloaded once its request ended")  # fmt: skip
        kinds = [e[1:] for e in _events_of(client)]
        assert kinds.index(["lora_unload", "policy-v1"]) > kinds.index(["generate_end", "default"])
        assert {c.policy_version for c in running["out"]} == {1}
        # This engine still names v1, which is gone: it asks again, with v2.
        assert engine.adapter == "policy-v1"
        out = engine.generate(prompts, params)
        assert {c.policy_version for c in out} == {2} and engine.adapter == "policy-v2"
        assert worst_gap(trainer, prompts, out) < 2e-5


@pytest.mark.slow
def test_a_server_with_data_parallel_replicas_is_refused_by_name():
    model, _ = lora_policy(4)
    named = adapter_of(model)
    with fake_servers(1, *LORA, "--dp-size", "2") as (client,):
        sender = SGLangLoRASender([("sg-0", client.url)], specs_of(named), 8.0, 2, 60)
        with pytest.raises(SGLangError, match="sg-0.*2 data-parallel replicas"):
            sender.push(named, 1)
        tensors = peft_tensors(named)
        config = peft_config({n: tuple(t.shape) for n, t in tensors.items()}, 8.0)
        _refused(lambda: _load_raw(client, "x", tensors, config, 1), 500, "data-parallel")


def test_the_launch_flags_come_from_train_lora():
    from relax_core.config import LoraConfig, SGLangConfig

    flags = lora_flags(LoraConfig(rank=16, target_modules="q_proj, v_proj"), keep=3)
    cmd = server_command("/py", "/m", 1, 1, 0, SGLangConfig(extra_args="--log-level x"), lora=flags)
    assert cmd[-10:] == [
        *("--enable-lora", "--max-lora-rank", "16", "--lora-target-modules", "q_proj", "v_proj"),
        *("--max-loras-per-batch", "3", "--log-level", "x"),  # the user's extra_args last
    ]
    assert lora_flags(LoraConfig(rank=0), keep=3) == []


# ---------------------------------------------------------------------------------- whole runs
LORA_RUN = {
    "train": {
        "total_steps": 3,
        "checkpoint_every": 1,
        "keep_checkpoints": 10,
        "steps_per_node": 10,
        "lr": 0.05,
        "lora": {"rank": 4, "alpha": 8},
    },
    "algorithm": {"entropy_coef": 0.01},
    "queue": {"retention": "keep"},
}


def _sampled_with_the_versions_they_record(run_name: str, *, on_policy: bool) -> None:
    """Every row's log-probs are those of the checkpoint of the version it records (the
    adapter that version loaded), and not of the version before (a stale adapter)."""
    from relax_core.models.policy import load_policy
    from relax_core.queue import TransferQueue
    from relax_core.train.checkpoint import find_resume_checkpoint, read_state

    state = read_state(find_resume_checkpoint(".relax/checkpoints", run_name))
    run_dir = os.path.join(".relax/checkpoints", state["run_id"])
    queue = TransferQueue(".relax/queue", state["run_id"])
    policies: dict[int, torch.nn.Module] = {}

    def policy(version: int):
        if version not in policies:
            path = os.path.join(run_dir, f"step_{version:06d}")
            policies[version] = load_policy(path)[0].eval()
        return policies[version]

    gaps, stale, versions = [], [], set()
    for seq in queue.committed("rollout"):
        for row in queue.read("rollout", seq).to_pylist():
            version = row["behaviour_version_min"]
            assert row["behaviour_version_max"] == version
            versions.add(version)
            reported = torch.tensor(row["rollout_logprobs"])
            prompt, response = row["prompt_ids"], row["response_ids"]
            gaps.append((sampled_logprobs(policy(version), prompt, response) - reported).abs())
            if version > 0:
                before = sampled_logprobs(policy(version - 1), prompt, response)
                stale.append((before - reported).abs().max().item())
    if on_policy:  # colocate: step s samples with version s-1, every one of them
        assert versions == {0, 1, 2}, versions
    else:
        # Which versions sample is the scheduler's business (an async rollout that loads v2
        # and v3 in quick succession may sample nothing with v2); the untrained base and a
        # trained adapter both must have sampled, and every version that did is checked above.
        assert 0 in versions and len(versions) >= 2, versions
    assert max(g.max().item() for g in gaps) < 2e-5
    assert min(stale) > 1e-2  # each version moved every row: a stale adapter would show


def _events(path) -> list[list]:
    return [json.loads(line)[1:] for line in path.read_text().splitlines()]


@pytest.mark.slow  # a whole async run: its roles' start-up alone is most of a minute here
def test_an_async_lora_run_samples_with_the_adapter_of_each_version(
    small_config, workdir, launches, monkeypatch
):
    events = workdir / "events.jsonl"
    monkeypatch.setenv("RELAX_TEST_SGLANG_EVENTS", str(events))
    cfg = small_config(
        "la.yaml",
        run_name="la",
        mode="async",
        rollout={"engine": "sglang", "max_staleness": 1},
        services={**SERVICES, "rollout_workers": 1},
        sglang={"start_timeout_s": 120},
        **LORA_RUN,
    )
    _run(cfg)
    _sampled_with_the_versions_they_record("la", on_policy=False)
    for argv in map(json.loads, launches.read_text().splitlines()):
        # The rollout worker's server and the evaluations': rank 4, the newest 3 versions
        # (max_staleness 1, + 2) in a batch.
        assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "4"
        assert argv[argv.index("--max-loras-per-batch") + 1] == "3"
    loaded = {e[1] for e in _events(events) if e[0] == "lora_load"}
    assert {f"policy-v{v}" for v in range(4)} <= loaded


@pytest.mark.slow
def test_a_colocate_lora_run_samples_with_the_adapter_of_each_version(
    small_config, workdir, launches, monkeypatch
):
    events = workdir / "events.jsonl"
    monkeypatch.setenv("RELAX_TEST_SGLANG_EVENTS", str(events))
    cfg = small_config(
        "lc.yaml",
        run_name="lc",
        rollout={"engine": "sglang"},
        sglang={"start_timeout_s": 120, "handoff_dir": str(workdir / "handoff")},
        **LORA_RUN,
    )
    _run(cfg)
    _sampled_with_the_versions_they_record("lc", on_policy=True)
    # Each version's adapter goes by name and the one before is unloaded; the base's weights
    # are never sent.
    kinds = _events(events)
    assert not [e for e in kinds if e[0] == "update_begin"]
    assert {e[1] for e in kinds if e[0] == "lora_load"} == {f"policy-v{v}" for v in range(4)}
    assert {e[1] for e in kinds if e[0] == "lora_unload"} >= {f"policy-v{v}" for v in range(3)}
