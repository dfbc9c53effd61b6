"""The warm start of an agent run learns the agent's own episodes: an agent module's
demonstration turns, replayed through the real endpoint and the agent against a scripted
policy, become rows laid out as RL samples them (the agent's prompt and tools through the chat
template, its tool results between the turns under loss_mask 0); episodes the agent judges wrong
are not kept; a module without a demonstration is named before launch."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from relax_core.agents.server import CallLimits
from relax_core.config import load_config, replace
from relax_core.models.tiny import CHARSET, build_char_tokenizer
from relax_core.roles.agent_demos import demonstration_of, replay
from relax_core.roles.agents import AgentRunner
from relax_core.roles.episodes import check_env

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REPO = Path(__file__).resolve().parents[2]
JSON_CHARS = '<>_{}[]"'  # what tool calls and schemas are written with, beyond the tiny charset
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]


def agent(sample, *, base_url, api_key, model):
    """Calls `calc` when the model asks, then checks the model's answer."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return float(message.content == f"= {sample['answer']}")
        for call in message.tool_calls:
            value = str(eval(json.loads(call.function.arguments)["x"]))  # test input only
            messages.append({"role": "tool", "tool_call_id": call.id, "content": value})
    return 0.0


def demonstration(sample):
    call = {"name": "calc", "arguments": {"x": sample["meta"]["expression"]}}
    value = eval(sample["meta"]["expression"])  # test input only
    return [f"<tool_call>\n{json.dumps(call)}\n</tool_call>", f"= {value}"]


def test_demonstrations_become_the_rows_rl_samples_and_wrong_ones_are_dropped():
    tok = build_char_tokenizer(CHARSET + JSON_CHARS)
    tok.chat_template = (REPO / "configs" / "templates" / "tiny-chat.jinja").read_text()
    runner = AgentRunner(agent, tok, CallLimits(3, 200, 200), 1, 30.0, tool_parser="hermes")
    rows = [
        {"prompt": "2*3?", "answer": "6", "meta": {"expression": "2*3"}},
        {"prompt": "4*5?", "answer": "21", "meta": {"expression": "4*5"}},  # the agent: wrong
        {"prompt": "7*8?", "answer": "56", "meta": {"expression": "7*8"}},
    ]
    try:
        examples = replay(runner, demonstration, rows, want=5, max_new_tokens=200)
        assert replay(runner, demonstration, rows, want=1, max_new_tokens=200) == examples[:1]
    finally:
        runner.close()
    assert len(examples) == 2
    prompt, response, mask = examples[0]
    text = tok.decode(prompt)
    assert '"name": "calc"' in text and text.endswith("user: 2*3?</s>\nassistant: ")
    call, answer = demonstration(rows[0])
    assert tok.decode(response) == f"{call}</s>\ntool: 6</s>\nassistant: {answer}</s>"
    trained = tok.decode([t for t, m in zip(response, mask, strict=True) if m])
    assert trained == f"{call}</s>{answer}</s>"  # the turns and their EOS only


def test_an_agent_module_without_a_demonstration_is_named_before_launch():
    assert demonstration_of("examples.agents.langchain_calculator:solve") is not None
    cfg = load_config(str(REPO / "configs" / "cpu-agent.yaml"))
    assert check_env(cfg) == []
    problems = check_env(replace(cfg, warm_start={"steps": 5}))
    assert len(problems) == 1 and "defines no demonstration(sample)" in problems[0], problems
