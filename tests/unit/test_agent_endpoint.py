"""The OpenAI-compatible endpoint: agents written against the `openai` client play episodes whose
rows hold exactly the tokens the engine saw and sampled (token in, token out, also under a
template that strips earlier reasoning); refusals, limits, crashes and timeouts cost only their
episode; concurrent calls share engine batches; an episode's segments count once in its group."""

from __future__ import annotations

import threading
import time

import openai
import pytest
import requests

from relax_core.agents.batcher import EngineBatcher
from relax_core.agents.server import CallLimits
from relax_core.data.prompts import PromptItem
from relax_core.models.tiny import build_char_tokenizer
from relax_core.queue import rows_to_table
from relax_core.roles import agents as roles_agents
from relax_core.roles.advantages import add_advantages
from relax_core.roles.agents import AgentRunner
from relax_core.rollout.engine import Completion, SamplingParams
from tests.agent_rows import sampled_runs

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHAT = (
    "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
)
# Earlier assistant turns lose their reasoning, written "(...)" before the reply, as thinking
# models' templates drop old <think> blocks.
THINKING = (
    "{%- for m in messages -%}{%- if m['role'] == 'assistant' and not loop.last -%}"
    "{{ m['role'] }}: {{ m['content'].split('(think) ')[-1] }}</s>\n"
    "{%- else -%}{{ m['role'] }}: {{ m['content'] }}</s>\n{%- endif -%}{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
)
PARAMS = SamplingParams(max_new_tokens=24)
LIMITS = CallLimits(max_calls=4, max_episode_tokens=200, max_new_tokens=24)


def tokenizer(template: str = CHAT):
    tok = build_char_tokenizer()
    tok.chat_template = template
    return tok


class ReplyEngine:
    """Answers each prompt with `reply(prompt text)` (EOS appended) and records every call, as
    the engine saw it: the oracle the rows are checked against."""

    def __init__(self, tok, reply, version: int = 3) -> None:
        self.tok, self.reply, self.version = tok, reply, version
        self.calls: list[tuple[list[int], list[int], list[float]]] = []
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def generate(self, prompts, params, media=None):
        out = []
        for prompt in prompts:
            text = self.reply(self.tok.decode(prompt))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            lps = [-(i % 7) / 10 - 0.01 for i in ids]
            with self.lock:
                self.calls.append((list(prompt), ids, lps))
            out.append(Completion(ids, lps, finish, self.version))
        self.batches.append(len(prompts))
        return out


def calculator_reply(text: str) -> str:
    """Calls the tool on the first turn, answers with the tool's value after it."""
    if "tool: " in text:
        return "Answer: " + text.rsplit("tool: ", 1)[1].split("<", 1)[0].strip("</s>\n")
    return "(think) calc(3*4)"


def calc_agent(sample, *, base_url, api_key, model):
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):
        text = client.chat.completions.create(model=model, messages=messages).choices[0]
        text = text.message.content
        messages.append({"role": "assistant", "content": text})
        if "calc(" in text:
            messages.append({"role": "tool", "content": "12"})
            continue
        ok = text.strip() == f"Answer: {sample['answer']}"
        return {
            "reward": float(ok),
            "correct": ok,
            "info": {"tool_calls": 1, "tool_calls_valid": 1},
        }
    return 0.0


def items(tok, n: int = 1) -> list[PromptItem]:
    rows = [{"prompt": f"What is 3*4? {i}", "answer": "12", "meta": {}} for i in range(n)]
    return [
        PromptItem(0, i, r, tok(r["prompt"], add_special_tokens=False)["input_ids"])
        for i, r in enumerate(rows)
    ]


def runner(tok, agent, limits=LIMITS, workers=8, timeout_s=30.0) -> AgentRunner:
    return AgentRunner(agent, tok, limits, workers, timeout_s)


def assert_rows_hold_engine_tokens(rows, engine) -> None:
    """Each run of loss_mask-1 tokens of each row is one engine call: its sampled ids, with
    their log-probs, after exactly that call's prompt; and every call is in some row."""
    calls = list(engine.calls)
    for row in rows:
        for context, sampled, span in sampled_runs(row):
            call = next(c for c in calls if c[0] == context and c[1] == sampled)
            assert row["rollout_logprobs"][span] == pytest.approx(call[2])
            calls.remove(call)
    assert calls == [], f"{len(calls)} engine calls are in no row"


def test_an_openai_client_agent_trains_rows_equal_to_the_engine_tokens():
    tok = tokenizer()
    engine = ReplyEngine(tok, calculator_reply)
    rows, metrics = runner(tok, calc_agent).rollout(engine, items(tok, 2), PARAMS, 2)
    assert len(rows) == 4 and len(engine.calls) == 8
    assert_rows_hold_engine_tokens(rows, engine)
    row = rows[0]
    assert row["uid"] == "e0-p0-s0" and row["turns"] == 2 and row["reward"] == 1.0
    assert row["finish_reason"] == "stop" and row["behaviour_version_min"] == 3
    # the tool's message is in the row, never trained
    response = tok.decode(row["response_ids"])
    assert "tool: 12" in response and 0 in row["loss_mask"]
    assert metrics["rollout/success_rate"] == 1.0 and metrics["rollout/tool_call_validity"] == 1.0
    assert metrics["rollout/segments_per_episode"] == 1.0
    rows_to_table(rows)  # the queue takes them as they are


def test_a_thinking_template_cannot_rewrite_tokens_the_engine_sampled():
    tok = tokenizer(THINKING)
    engine = ReplyEngine(tok, calculator_reply)
    rows, _ = runner(tok, calc_agent).rollout(engine, items(tok), PARAMS, 1)
    assert len(rows) == 1
    assert_rows_hold_engine_tokens(rows, engine)
    # the reasoning of turn 1 stays in the context of turn 2, as the engine saw it ...
    second_prompt = tok.decode(engine.calls[1][0])
    assert "(think) calc(3*4)" in second_prompt
    # ... where re-rendering the history through the template would have dropped it
    history = [
        {"role": "user", "content": "What is 3*4? 0"},
        {"role": "assistant", "content": "(think) calc(3*4)"},
        {"role": "tool", "content": "12"},
    ]
    rerendered = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
    assert "(think)" not in rerendered


def test_an_agent_that_rewrites_its_history_starts_a_new_segment_counted_once():
    tok = tokenizer(THINKING)

    def stripping_agent(sample, *, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        messages = [{"role": "user", "content": sample["prompt"]}]
        text = client.chat.completions.create(model=model, messages=messages)
        # the client itself drops the reasoning from its history before the next call
        messages.append({"role": "assistant", "content": text.choices[0].message.content[8:]})
        messages.append({"role": "tool", "content": "12"})
        client.chat.completions.create(model=model, messages=messages)
        return 1.0

    engine = ReplyEngine(tok, calculator_reply)
    rows, metrics = runner(tok, stripping_agent).rollout(engine, items(tok), PARAMS, 2)
    assert [r["uid"] for r in rows] == ["e0-p0-s0", "e0-p0-s0/seg1", "e0-p0-s1", "e0-p0-s1/seg1"]
    assert_rows_hold_engine_tokens(rows, engine)
    # the new segment's prompt is the rewritten history as rendered, never re-fit to the old
    second = tok.decode(rows[1]["prompt_ids"])
    assert "assistant: calc(3*4)" in second and "(think)" not in second
    assert metrics["rollout/segments_per_episode"] == 2.0
    # two episodes, rewards 1 and 0 (both of prompt 0): +-1 each, whatever the segments
    rows[2]["reward"] = rows[3]["reward"] = 0.0
    table = add_advantages(rows_to_table(rows), "grpo", True)
    firsts = [a[0] for a in table.column("advantages").to_pylist()]
    assert firsts == pytest.approx([1.0, 1.0, -1.0, -1.0], abs=1e-4)


def test_text_completions_extend_the_exact_tokens_and_take_token_ids():
    tok = tokenizer()

    def completion_agent(sample, *, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        prompt = sample["prompt"] + "\n"
        first = client.completions.create(model=model, prompt=prompt, logprobs=1)
        assert first.choices[0].logprobs.token_logprobs
        prompt += first.choices[0].text + "\ntool: 12\n"
        client.completions.create(model=model, prompt=prompt)
        ids = tok("What is", add_special_tokens=False)["input_ids"]
        client.completions.create(model=model, prompt=ids)
        return 0.5

    engine = ReplyEngine(tok, calculator_reply)
    rows, _ = runner(tok, completion_agent).rollout(engine, items(tok), PARAMS, 1)
    # the first two calls make one segment (EOS kept between them), the token-id call another
    assert len(rows) == 2 and rows[0]["turns"] == 2 and rows[1]["turns"] == 1
    assert_rows_hold_engine_tokens(rows, engine)
    assert tok.eos_token_id in rows[0]["response_ids"][:-1]


def test_refused_requests_say_why_and_record_nothing():
    tok = tokenizer()
    seen: dict[str, str] = {}

    def probing_agent(sample, *, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": "hi"}]
        for name, extra in {
            "n": {"n": 2},
            "seed": {"seed": 1},
        }.items():
            try:
                client.chat.completions.create(model=model, messages=msgs, **extra)
            except openai.BadRequestError as err:
                seen[name] = str(err)
        image = [{"type": "image_url", "image_url": {"url": "data:,"}}]
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": image}]
            )
        except openai.BadRequestError as err:
            seen["image"] = str(err)
        try:
            openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
        except openai.AuthenticationError as err:
            seen["token"] = str(err)
        seen["models"] = client.models.list().data[0].id
        seen["unknown"] = str(
            requests.get(base_url.rsplit("/", 3)[0] + "/nope/x/v1/models").status_code
        )
        return 0.0

    engine = ReplyEngine(tok, calculator_reply)
    rows, _ = runner(tok, probing_agent).rollout(engine, items(tok), PARAMS, 1)
    assert engine.calls == [] and rows[0]["response_ids"] == [] and rows[0]["turns"] == 0
    assert "one choice per call" in seen["n"] and "seed=1 is not supported" in seen["seed"]
    assert "image_url" in seen["image"]
    assert "bearer token" in seen["token"] and seen["models"] == "policy"
    assert seen["unknown"] == "401"


class HungAgentClock:
    """The runner's clock (relax_core/roles/agents.py), real until the runner has collected every
    episode but the hung one, then an hour on: that episode is past any env.agent_timeout_s at
    once, and the others had all the time a loaded machine needed."""

    def __init__(self, endpoint, collected_before_hang: int) -> None:
        self.closed, self.wanted = 0, collected_before_hang
        close = endpoint.close_episode

        def counting_close(eid):
            self.closed += 1
            return close(eid)

        endpoint.close_episode = counting_close

    def monotonic(self) -> float:
        return time.monotonic() + (3600.0 if self.closed >= self.wanted else 0.0)

    perf_counter = staticmethod(time.perf_counter)


def test_limits_end_the_episode_and_a_crash_or_timeout_costs_only_its_own(monkeypatch):
    tok = tokenizer()
    hung_called, release = threading.Event(), threading.Event()

    def chatty_agent(sample, *, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        kind = sample["prompt"][-1]
        msgs = [{"role": "user", "content": sample["prompt"]}]
        if kind == "1":
            raise RuntimeError("the agent's own bug")
        if kind == "2":
            client.chat.completions.create(model=model, messages=msgs)
            hung_called.set()
            release.wait(timeout=60)  # hangs until the test ends
            return 1.0
        hung_called.wait(timeout=60)  # so the hung episode has a recorded call to keep
        for _ in range(5):  # kind 0: one call past max_calls
            client.chat.completions.create(model=model, messages=msgs)
        return 1.0

    engine = ReplyEngine(tok, calculator_reply)
    limits = CallLimits(max_calls=3, max_episode_tokens=200, max_new_tokens=24)
    agents = runner(tok, chatty_agent, limits, timeout_s=60)
    clock = HungAgentClock(agents.endpoint, collected_before_hang=2)
    monkeypatch.setattr(roles_agents, "time", clock)
    try:
        rows, metrics = agents.rollout(engine, items(tok, 3), PARAMS, 1)
    finally:
        release.set()
        agents.close()
    by_prompt = {r["prompt_index"]: r for r in rows if "/seg" not in r["uid"]}
    info = [by_prompt[i]["reward_info"] for i in range(3)]
    assert [i["end_reason"] for i in info] == ["max_turns", "agent_error", "timeout"]
    assert "the agent's own bug" in info[1]["agent_error"]
    assert "env.agent_timeout_s (60" in info[2]["agent_error"]
    # the crashed and timed-out episodes train nothing and score 0; the others are kept
    assert by_prompt[2]["response_ids"] and sum(by_prompt[2]["loss_mask"]) == 0
    assert by_prompt[2]["finish_reason"] == "abort" and by_prompt[2]["reward"] == 0.0
    assert sum(by_prompt[0]["loss_mask"]) > 0 and by_prompt[0]["reward"] == 0.0
    assert info[0]["calls"] == 3  # the fourth call was refused, not recorded
    assert metrics["rollout/agent_errors"] == 1.0 and metrics["rollout/agent_timeouts"] == 1.0


class FirstBatchWaits(ReplyEngine):
    """Its first batch lasts until every episode's first call has reached the batcher, as a real
    engine's slow first batch lets the others gather: they must then go out together. (With an
    instant engine the batches' sizes follow the threads' timing: a loaded machine once gave at
    most 3.)"""

    def __init__(self, tok, reply, episodes: int) -> None:
        super().__init__(tok, reply)
        self.episodes, self.submitted = episodes, 0
        self.all_first_calls = threading.Event()

    def count(self, submit):
        def counted(batcher, prompt_ids, cap):
            with self.lock:
                self.submitted += 1
                if self.submitted >= self.episodes:
                    self.all_first_calls.set()
            return submit(batcher, prompt_ids, cap)

        return counted

    def generate(self, prompts, params, media=None):
        if not self.batches:
            assert self.all_first_calls.wait(timeout=60), f"{self.submitted} calls arrived"
        return super().generate(prompts, params, media)


def test_concurrent_episodes_share_engine_batches(monkeypatch):
    tok = tokenizer()
    engine = FirstBatchWaits(tok, calculator_reply, episodes=8)
    monkeypatch.setattr(EngineBatcher, "submit", engine.count(EngineBatcher.submit))
    rows, _ = runner(tok, calc_agent).rollout(engine, items(tok, 4), PARAMS, 2)
    assert len(engine.calls) == 16 and len(rows) == 8
    # The first batch took k of the 8 first calls and the next one the other 8 - k at least.
    assert max(engine.batches) >= 4 and len(engine.batches) < 16


def test_the_run_temperature_applies_and_asking_for_another_is_counted():
    tok = tokenizer()

    def hot_agent(sample, *, base_url, api_key, model):
        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = [{"role": "user", "content": sample["prompt"]}]
        client.chat.completions.create(model=model, messages=msgs, temperature=1.7)
        return 0.0

    engine = ReplyEngine(tok, calculator_reply)
    _, metrics = runner(tok, hot_agent).rollout(engine, items(tok), PARAMS, 2)
    assert metrics["rollout/sampling_overrides"] == 2.0
