"""Agents written with LangChain, the OpenAI Agents SDK and smolagents (examples/agents/) train
unchanged through the OpenAI-compatible endpoint: a scripted policy writes a Hermes tool call on
its first turn and its answer once the tool's result is in its prompt, and each framework, left
as its docs show, runs the calculator with the model's arguments, hands the result back, and
scores the episode; the rows hold exactly the tokens the engine saw and sampled, in one segment
wherever the framework sends the endpoint's reply back as it was given, and a streaming agent
trains the same rows as its plain variant."""

from __future__ import annotations

import json
import re
import threading

import pytest

from relax_core.agents.server import CallLimits
from relax_core.data.prompts import PromptItem
from relax_core.models.tiny import build_char_tokenizer
from relax_core.roles.agents import AgentRunner
from relax_core.rollout.engine import Completion, SamplingParams
from tests.agent_rows import assert_rows_hold_engine_calls
from tests.needs import module

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

INSTALL = "pip install -e '.[agents]'"
for _name in ("langchain_openai", "agents", "smolagents"):
    module(_name, INSTALL)

from examples.agents import langchain_agent, openai_agents_sdk_agent, smolagents_agent  # noqa: E402

# Every printable ASCII character is a token: the frameworks' prompts and tool-call JSON.
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n"
# A Hermes-style template: the offered tools' names in a system turn, an assistant turn's tool
# calls as <tool_call>{...}</tool_call> blocks, tool results as `tool` turns.
TEMPLATE = (
    "{%- if tools -%}system: tools: "
    "{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}</s>\n"
    "{% endif -%}"
    "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}"
    "{%- for c in m.tool_calls or [] -%}<tool_call>"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}"
    "</tool_call>{%- endfor -%}</s>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
)
QUESTION, EXPRESSION, ANSWER = "What is 17*23-5?", "17*23-5", "386"
ASKED = re.compile(r"What is (\d[\d*+\- ]*)\?")
# A tool's result as each framework hands it back: a `tool` turn (LangChain, Agents SDK), or an
# observation in a user turn (smolagents; a CodeAgent's holds its code's printed output).
RESULT = re.compile(r"(?:tool: |Observation:\n(?:Execution logs:\n)?)(-?\d+)")
PARAMS = SamplingParams(max_new_tokens=120)
LIMITS = CallLimits(max_calls=6, max_episode_tokens=2000, max_new_tokens=120)


def policy(prompt: str) -> str:
    """The reply a tool-using model would write to `prompt` (its text as the engine sees it)."""
    asked = list(ASKED.finditer(prompt))[-1]
    result = RESULT.search(prompt[asked.end() :])
    offered = re.match(r"system: tools: (.*)</s>", prompt)
    if offered is None:  # a CodeAgent: Python in <code> blocks, tools are functions
        code = (
            f'final_answer("{result.group(1)}")'
            if result
            else f'print(calculator(expression="{asked.group(1)}"))'
        )
        return f"Thought: the calculator knows.\n<code>\n{code}\n</code>"
    if result is None:
        call = {"name": "calculator", "arguments": {"expression": asked.group(1)}}
    elif "final_answer" in offered.group(1).split(", "):
        call = {"name": "final_answer", "arguments": {"answer": result.group(1)}}
    else:
        return f"Answer: {result.group(1)}"
    # tool_choice="required": the endpoint has opened the call in the prompt already
    opened = prompt.endswith("<tool_call>\n")
    return ("" if opened else "<tool_call>") + json.dumps(call) + "</tool_call>"


class PolicyEngine:
    """Answers each prompt with `policy(prompt text)` and EOS, and records every call as the
    engine saw it (prompt ids, sampled ids, log-probs): the oracle the rows are checked
    against."""

    def __init__(self, tok) -> None:
        self.tok, self.version = tok, 2
        self.calls: list[tuple[list[int], list[int], list[float]]] = []
        self.lock = threading.Lock()

    def generate(self, prompts, params, media=None):
        out = []
        for prompt in prompts:
            text = policy(self.tok.decode(prompt))
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            lps = [-(i % 7) / 10 - 0.01 for i in ids]
            with self.lock:
                self.calls.append((list(prompt), ids, lps))
            out.append(Completion(ids, lps, "stop", self.version))
        return out

    def prompt_text(self, k: int) -> str:
        return self.tok.decode(self.calls[k][0])


def tokenizer():
    tok = build_char_tokenizer(CHARSET)
    tok.chat_template = TEMPLATE
    return tok


def play(agent) -> tuple[list[dict], dict, PolicyEngine]:
    """One episode of `agent` on the question: its rows, the rollout metrics, the engine."""
    tok = tokenizer()
    engine = PolicyEngine(tok)
    row = {"prompt": QUESTION, "answer": ANSWER, "meta": {}}
    item = PromptItem(0, 0, row, tok(QUESTION, add_special_tokens=False)["input_ids"])
    runner = AgentRunner(agent, tok, LIMITS, workers=1, timeout_s=120.0)
    try:
        rows, metrics = runner.rollout(engine, [item], PARAMS, 1)
    finally:
        runner.close()
    return rows, metrics, engine


def assert_episode_succeeded(
    rows, metrics, calls, turns: int, segments: int, tool_calls: int = 1
) -> None:
    """The episode ended with the right answer and its tool call counted valid, in `turns`
    engine calls and `segments` rows, which hold exactly `calls` (prompt, sampled, log-probs)."""
    info = rows[0]["reward_info"]
    assert info["end_reason"] == "done", info
    assert [r["reward"] for r in rows] == [1.0] * segments
    assert info["agent_info"] == {"tool_calls": tool_calls, "tool_calls_valid": tool_calls}
    assert metrics["rollout/success_rate"] == 1.0
    assert metrics["rollout/tool_call_validity"] == 1.0
    assert len(calls) == turns and sum(r["turns"] for r in rows) == turns
    assert metrics["rollout/segments_per_episode"] == segments and len(rows) == segments
    assert_rows_hold_engine_calls(rows, calls)


def cut_at(calls, stop: str):
    """The engine's calls as a row keeps them under a `stop` string: each call's sampled ids up
    to the one that completes the string (one token per character here)."""
    tok, out = tokenizer(), []
    for prompt, ids, lps in calls:
        text = tok.decode(ids)
        k = text.find(stop) + len(stop) if stop in text else len(ids)
        out.append((prompt, ids[:k], lps[:k]))
    return out


def same_rows(a: list[dict], b: list[dict]) -> None:
    keys = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "reward", "turns")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]


@pytest.mark.parametrize(
    "agent",
    [langchain_agent.solve, openai_agents_sdk_agent.solve],
    ids=["langchain", "openai_agents_sdk"],
)
def test_a_tool_calling_framework_agent_trains_one_segment_of_engine_tokens(agent):
    rows, metrics, engine = play(agent)
    # The tool ran with the model's arguments: its value (only 17*23-5 gives 386) is a `tool`
    # turn of the next prompt, after the model's call as the template renders it.
    second = engine.prompt_text(1)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23-5"}}</tool_call>'
    assert call in second and f"tool: {ANSWER}</s>" in second
    assert "system: tools: calculator</s>" in engine.prompt_text(0)
    # The framework sent the reply back as the endpoint gave it (content and tool_calls): one
    # segment, the tool's turn in it untrained.
    assert_episode_succeeded(rows, metrics, engine.calls, turns=2, segments=1)
    text = tokenizer().decode(rows[0]["response_ids"])
    assert text.endswith(f"Answer: {ANSWER}</s>") and 0 in rows[0]["loss_mask"]


@pytest.mark.parametrize(
    "plain, streaming",
    [
        (langchain_agent.solve, langchain_agent.solve_streaming),
        (openai_agents_sdk_agent.solve, openai_agents_sdk_agent.solve_streaming),
    ],
    ids=["langchain", "openai_agents_sdk"],
)
def test_a_streaming_framework_agent_trains_the_rows_of_its_plain_variant(plain, streaming):
    rows, metrics, engine = play(streaming)
    assert_episode_succeeded(rows, metrics, engine.calls, turns=2, segments=1)
    same_rows(rows, play(plain)[0])


def test_a_smolagents_tool_calling_agent_trains_its_turns_as_segments():
    rows, metrics, engine = play(smolagents_agent.solve_tool_calling)
    # smolagents asks for a call (tool_choice="required"): the endpoint opened it in the prompt
    assert engine.prompt_text(0).endswith("assistant: <tool_call>\n")
    assert f"Observation:\n{ANSWER}" in engine.prompt_text(1)
    # smolagents sends its history back in its own words (the call as "Calling tools: [...]"
    # text, the result as a user turn), never as the endpoint's reply: each call renders whole
    # and starts a segment, every sampled token trained in the context it was sampled in.
    assert_episode_succeeded(rows, metrics, engine.calls, turns=2, segments=2)
    streamed, stream_metrics, stream_engine = play(smolagents_agent.solve_tool_calling_streaming)
    assert_episode_succeeded(streamed, stream_metrics, stream_engine.calls, turns=2, segments=2)
    # the same sampled tokens (the call ids smolagents writes into its history are random)
    assert [c[1] for c in stream_engine.calls] == [c[1] for c in engine.calls]


def test_a_smolagents_code_agent_runs_the_models_code_with_the_tool():
    rows, metrics, engine = play(smolagents_agent.solve_code)
    # the code the model wrote called the calculator, and its printed value came back
    assert f"Execution logs:\n{ANSWER}\n" in engine.prompt_text(1)
    # smolagents stops a turn at "</code>" (`stop`): the rows keep the sampled ids up to it.
    # Its history repeats the model's text, then adds its own: the next prompt, rendered whole,
    # extends the tokens so far, so the episode stays one segment. Both code actions count as
    # tool calls.
    calls = cut_at(engine.calls, "</code>")
    assert_episode_succeeded(rows, metrics, calls, turns=2, segments=1, tool_calls=2)


def test_the_langchain_tool_answers_arguments_off_its_schema_with_an_error():
    # A learning model writes some calls whose arguments do not fit the tool's schema: the
    # episode goes on with the error as the tool's answer (counted invalid), not a crash that
    # would cost the whole episode.
    call = {"name": "calculator", "args": {"expression": {"type": "number"}}, "id": "call_1"}
    message = langchain_agent.calculator.invoke({**call, "type": "tool_call"})
    assert message.status == "error" and message.content.startswith("error: invalid arguments")
    assert message.tool_call_id == "call_1"
