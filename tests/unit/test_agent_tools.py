"""The endpoint speaks OpenAI as agent frameworks need it: tool calls come back as `tool_calls`
and the tool turn continues the same row token for token, whatever form the framework sends the
reply back in; `stop` cuts a turn where OpenAI would (rows keep exactly the sampled tokens up to
the cut); `stream: true` answers the real `openai` client's streaming and records the same rows;
every field it cannot honour is refused by name; tools a template would hide and prompts past the
policy's context are refused. Through the real HTTP endpoint and the real `openai` client, with a
scripted engine."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import openai
import pytest

from relax_core.agents.server import CallLimits
from relax_core.agents.toolcalls import PARSERS, parse_reply
from relax_core.config import ConfigError, load_config, replace
from relax_core.config.checks import TOOL_PARSERS
from relax_core.models.tiny import CHARSET, build_char_tokenizer
from relax_core.roles.agents import AgentRunner
from relax_core.rollout.engine import SamplingParams
from tests.agent_rows import sampled_runs
from tests.unit.test_agent_endpoint import (
    CHAT,
    ReplyEngine,
    assert_rows_hold_engine_tokens,
    items,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# Renders tools as a header and an assistant's tool calls in the hermes format.
TOOLS = (
    "{%- if tools -%}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>\n"
    "{% endif -%}"
    "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}"
    "{%- for c in (m['tool_calls'] if m['tool_calls'] is defined else []) -%}"
    "<tool_call>{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']}"
    " | tojson }}</tool_call>{%- endfor -%}</s>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
)
# Qwen3's ways with tool turns: no conversation without a user query, and the think block of
# an assistant turn after it only while that turn is last.
QWEN3_LIKE = (
    "{%- set ns = namespace(query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.query = loop.index0 -%}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if ns.query < 0 -%}{{ raise_exception('No user query found in messages.') }}{%- endif -%}"
    "{%- if tools -%}tools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}</s>\n"
    "{% endif -%}"
    "{%- for m in messages -%}{{ m['role'] + ': ' }}"
    "{%- if m['role'] == 'assistant' and loop.last and loop.index0 > ns.query -%}<think>"
    "{%- endif -%}{{ m['content'] }}</s>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
)
CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "evaluate an arithmetic expression",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}},
    },
}
ARGS = '{"expr": "3*4"}'
AGENT = str(Path(__file__).parents[2] / "configs" / "cpu-agent.yaml")
PARAMS = SamplingParams(max_new_tokens=120)
LIMITS = CallLimits(max_calls=4, max_episode_tokens=400, max_new_tokens=120, context=512)


def tokenizer(template: str = TOOLS):
    tok = build_char_tokenizer(CHARSET + '<>{}"_;|!')
    tok.add_tokens(["D!"])  # one token holding the end of the stop string "END" and more
    tok.chat_template = template
    return tok


def tool_reply(text: str) -> str:
    """A model that calls calc (an unknown tool after prompt '3'), then answers from its
    result; after a forced call opening it writes the rest of the call."""
    if text.endswith("<tool_call>\n"):
        return '{"name": "calc", "arguments": ' + ARGS + "}</tool_call>"
    if "tool: " in text:
        return "Answer: " + text.rsplit("tool: ", 1)[1].split("<", 1)[0]
    name = "nope" if "3*4? 3" in text else "calc"
    before = "" if "3*4? 2" in text else "Let me compute."  # a reply that is only a call
    return f'{before}<tool_call>{{"name": "{name}", "arguments": {ARGS}}}</tool_call>'


def run(tok, agent, engine, n_items=1, n_samples=1, limits=LIMITS):
    agents = AgentRunner(agent, tok, limits, 8, 30.0)
    try:
        return agents.rollout(engine, items(tok, n_items), PARAMS, n_samples)
    finally:
        agents.close()


def client(base_url, api_key):
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def sent_back(message, form: str) -> dict:
    """The assistant message as each framework sends it back."""
    calls = [c.model_dump() for c in message.tool_calls]
    if form == "openai":  # the client's own object, every null field included
        return {**message.model_dump(exclude_none=False), "annotations": []}
    if form == "langchain":  # content '' and arguments re-serialized from the parsed dict
        for c in calls:
            c["function"]["arguments"] = json.dumps(
                json.loads(c["function"]["arguments"]), separators=(",", ":")
            )
        return {"role": "assistant", "content": message.content or "", "tool_calls": calls}
    return {"role": "assistant", "content": message.content, "tool_calls": calls}  # Agents SDK


@pytest.mark.parametrize("template", [TOOLS, QWEN3_LIKE], ids=["hermes", "qwen3-like"])
def test_tool_calls_come_back_as_tool_calls_and_the_tool_turn_extends_the_same_row(template):
    tok = tokenizer(template)
    seen: dict[str, object] = {}

    def tool_agent(sample, *, base_url, api_key, model):
        c = client(base_url, api_key)
        kind = sample["prompt"][-1]
        msgs = [{"role": "user", "content": sample["prompt"]}]
        first = c.chat.completions.create(model=model, messages=msgs, tools=[CALC]).choices[0]
        if kind == "3":  # an unknown tool: the text stays content, counted
            seen["bad"] = (first.finish_reason, first.message.content, first.message.tool_calls)
            return 0.0
        seen[kind] = first
        if kind == "2":  # a reply that is only a call: content null
            assert first.message.content is None and first.finish_reason == "tool_calls"
        call = first.message.tool_calls[0]
        msgs.append(sent_back(first.message, {"0": "openai", "1": "langchain"}.get(kind, "sdk")))
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "12"})
        second = c.chat.completions.create(model=model, messages=msgs, tools=[CALC])
        ok = second.choices[0].message.content == "Answer: 12"
        return {"reward": float(ok), "correct": ok}

    engine = ReplyEngine(tok, tool_reply)
    rows, metrics = run(tok, tool_agent, engine, n_items=4)
    first = seen["0"]
    assert first.finish_reason == "tool_calls" and first.message.content == "Let me compute."
    (call,) = first.message.tool_calls
    assert re.fullmatch(r"call_[0-9a-f]{24}", call.id) and call.type == "function"
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "3*4"}
    # each reply-back form continues the row: one segment, two calls, the tool turn untrained
    for row in rows[:3]:
        assert row["turns"] == 2 and row["reward"] == 1.0 and "/seg" not in row["uid"]
        assert "tool: 12" in tok.decode(row["response_ids"])
    assert metrics["rollout/segments_per_episode"] == 1.0
    assert_rows_hold_engine_tokens(rows, engine)
    # the second prompt is the first call's exact tokens, then the tool turn's template text
    prompt1, sampled1, _ = next(c for c in engine.calls if c[0] == rows[0]["prompt_ids"])
    prompt2 = next(
        c[0] for c in engine.calls if c[0][: len(prompt1)] == prompt1 and c[0] != prompt1
    )
    tail = prompt2[len(prompt1) + len(sampled1) :]
    assert prompt2[: len(prompt1) + len(sampled1)] == prompt1 + sampled1
    assert tok.decode(tail) == "\ntool: 12</s>\nassistant: "
    # an invalid call is left as content and counted
    assert seen["bad"][0] == "stop" and seen["bad"][2] is None and "nope" in seen["bad"][1]
    assert metrics["rollout/tool_parse_errors"] == 1.0


def test_stop_cuts_where_openai_would_and_the_row_keeps_the_sampled_tokens_to_the_cut():
    tok = tokenizer()
    got: dict[str, object] = {}

    def reply(text: str) -> str:
        return "ok" if "go on" in text else "Let me see END! then more"

    def stop_agent(sample, *, base_url, api_key, model):
        c = client(base_url, api_key)
        msgs = [{"role": "user", "content": sample["prompt"]}]
        first = c.chat.completions.create(model=model, messages=msgs, stop="END").choices[0]
        got["first"] = first
        msgs += [{"role": "assistant", "content": first.message.content}]
        msgs += [{"role": "user", "content": "go on"}]
        c.chat.completions.create(model=model, messages=msgs)
        return 1.0

    engine = ReplyEngine(tok, reply)
    rows, _ = run(tok, stop_agent, engine)
    first = got["first"]
    assert first.message.content == "Let me see " and first.finish_reason == "stop"
    (row,) = rows
    prompt1, sampled1, lps1 = engine.calls[0]
    # the stop string ends inside the token "D!": the row keeps it, and nothing after it
    k = [tok.decode([t]) for t in sampled1].index("D!") + 1
    (ctx1, run1, span1), (ctx2, run2, _) = sampled_runs(row)
    assert ctx1 == prompt1 and run1 == sampled1[:k]
    assert row["rollout_logprobs"][span1] == pytest.approx(lps1[:k])
    # the next call continues from exactly those tokens: the template's end-of-turn, then the
    # user turn, all observation tokens
    prompt2 = engine.calls[1][0]
    tail = tok("</s>\nuser: go on</s>\nassistant: ", add_special_tokens=False)["input_ids"]
    assert ctx2 == prompt2 == prompt1 + sampled1[:k] + tail
    assert row["loss_mask"][k : k + len(tail)] == [0] * len(tail)


def test_streamed_calls_parse_in_the_openai_client_and_record_what_unstreamed_calls_do():
    tok = tokenizer()
    turn = itertools.count()
    streamed: list[dict] = []

    def chat(c, model, msgs, stream):
        if not stream:
            return c.chat.completions.create(model=model, messages=msgs, tools=[CALC]).choices[0]
        content, calls, finish, usage = "", {}, None, None
        for chunk in c.chat.completions.create(
            model=model,
            messages=msgs,
            tools=[CALC],
            stream=True,
            stream_options={"include_usage": True},
        ):
            usage = chunk.usage or usage
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or ():
                    slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] += d.id or ""
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
                finish = ch.finish_reason or finish
        streamed.append({"content": content, "calls": calls, "finish": finish, "usage": usage})
        return calls, content

    def agent(sample, *, base_url, api_key, model):
        c = client(base_url, api_key)
        stream = next(turn) % 2 == 0
        msgs = [{"role": "user", "content": sample["prompt"]}]
        first = chat(c, model, msgs, stream)
        if stream:
            calls, content = first
            tool_calls = [
                {
                    "id": v["id"],
                    "type": "function",
                    "function": {"name": v["name"], "arguments": v["arguments"]},
                }
                for v in calls.values()
            ]
            reply = {"role": "assistant", "content": content or None, "tool_calls": tool_calls}
        else:
            reply = sent_back(first.message, "sdk")
        msgs += [
            reply,
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "12"},
        ]
        chat(c, model, msgs, stream)
        if stream:
            text = "".join(
                ch.choices[0].text
                for ch in c.completions.create(model=model, prompt="What", stream=True)
                if ch.choices
            )
            assert text == c.completions.create(model=model, prompt="What").choices[0].text
        return 1.0

    engine = ReplyEngine(tok, tool_reply)
    rows, _ = run(tok, agent, engine, n_samples=2)
    first, second = streamed[0], streamed[1]
    assert first["finish"] == "tool_calls" and first["content"] == "Let me compute."
    (call,) = first["calls"].values()
    assert call["name"] == "calc" and json.loads(call["arguments"]) == {"expr": "3*4"}
    assert call["id"].startswith("call_") and first["usage"].completion_tokens > 0
    assert second["content"] == "Answer: 12" and second["finish"] == "stop"
    # the streamed episode's row is the unstreamed one's, token for token, in one segment
    episodes = [r for r in rows if r["turns"] == 2]
    assert len(episodes) == 2 and len({r["uid"] for r in episodes}) == 2
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
        assert episodes[0][key] == episodes[1][key]
    assert_rows_hold_engine_tokens(rows, engine)


def test_tool_choice_required_opens_the_call_in_the_prompt_and_the_model_writes_the_rest():
    tok = tokenizer()
    got = {}

    def agent(sample, *, base_url, api_key, model):
        c = client(base_url, api_key)
        msgs = [{"role": "user", "content": sample["prompt"]}]
        for choice in ("required", {"type": "function", "function": {"name": "calc"}}):
            got[str(choice)] = c.chat.completions.create(
                model=model,
                messages=msgs,
                tools=[CALC],
                tool_choice=choice,
                parallel_tool_calls=False,
            ).choices[0]
        got_none = c.chat.completions.create(
            model=model, messages=msgs, tools=[CALC], tool_choice="none"
        ).choices[0]
        got["none"] = (got_none.finish_reason, got_none.message.content)
        twice = [{"role": "user", "content": "twice"}]
        got["parallel"] = c.chat.completions.create(
            model=model, messages=twice, tools=[CALC], parallel_tool_calls=False
        ).choices[0]
        return 1.0

    def reply(text):
        if text.endswith('"arguments":'):
            return " " + ARGS + "}</tool_call>"
        if "twice" in text:
            return 2 * '<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
        return tool_reply(text)

    engine = ReplyEngine(tok, reply)
    rows, _ = run(tok, agent, engine)
    # tool_choice none: the tools are shown, the reply is not parsed
    assert got.pop("none") == ("stop", tool_reply("3*4? 0"))
    for choice in got.values():
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "calc"
    assert len(got["parallel"].message.tool_calls) == 1  # parallel_tool_calls false: the first
    # the opening is prompt (never trained); the row holds exactly what the engine sampled
    assert tok.decode(engine.calls[0][0]).endswith("assistant: <tool_call>\n")
    assert_rows_hold_engine_tokens(rows, engine)


@pytest.mark.parametrize(
    ("parser", "text", "calls", "content", "errors"),
    [
        (
            "hermes",
            f'a<tool_call>{{"name": "calc", "arguments": {ARGS}}}</tool_call>'
            f'<tool_call>{{"name": "calc", "arguments": {ARGS}}}</tool_call>',
            2,
            "a",
            0,
        ),
        ("hermes", '<tool_call>{"name": "calc", "arguments": {</tool_call>', 0, None, 1),
        ("hermes", "plain answer", 0, "plain answer", 0),
        (
            "llama3_json",
            f'<|python_tag|>{{"name": "calc", "parameters": {ARGS}}}; '
            f'{{"name": "calc", "arguments": {ARGS}}}',
            2,
            None,
            0,
        ),
        ("llama3_json", '{"name": "calc", "parameters": 3}', 0, None, 1),
        ("llama3_json", "The answer is 12", 0, "The answer is 12", 0),
        ("none", f'<tool_call>{{"name": "calc", "arguments": {ARGS}}}</tool_call>', 0, None, 0),
    ],
)
def test_parsers_read_their_formats_and_count_what_is_not_a_call(
    parser, text, calls, content, errors
):
    parsed = parse_reply(parser, text, {"calc"})
    assert len(parsed.tool_calls) == calls and parsed.errors == errors
    assert parsed.content == (text if content is None and not calls else content)
    assert all(json.loads(c["function"]["arguments"]) == {"expr": "3*4"} for c in parsed.tool_calls)


def test_tool_parser_is_checked_before_launch():
    assert set(PARSERS) == set(TOOL_PARSERS)
    with pytest.raises(ConfigError, match=re.escape("env.tool_parser: unknown 'qwen'")):
        replace(load_config(AGENT), env={"tool_parser": "qwen"})


def test_what_the_endpoint_cannot_honour_is_refused_by_name():
    tok = tokenizer()
    seen: dict[str, openai.BadRequestError] = {}
    asks = {
        "n": {"n": 2},
        "seed": {"seed": 7},
        "frequency_penalty": {"frequency_penalty": 0.5},
        "presence_penalty": {"presence_penalty": 0.5},
        "logit_bias": {"logit_bias": {"5": 10}},
        "response_format": {"response_format": {"type": "json_object"}},
        "store": {"store": True},
        "top_logprobs": {"logprobs": True, "top_logprobs": 3},
        "reasoning_effort": {"reasoning_effort": "high"},
        "unknown_field": {"extra_body": {"unknown_field": 1}},
        "tool_choice": {
            "tools": [CALC],
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    }

    def agent(sample, *, base_url, api_key, model):
        c = client(base_url, api_key)
        msgs = [{"role": "user", "content": sample["prompt"]}]
        for name, extra in asks.items():
            try:
                c.chat.completions.create(model=model, messages=msgs, **extra)
            except openai.BadRequestError as err:
                seen[name] = err
        try:  # a refused streamed request is a plain 400, as unstreamed
            c.chat.completions.create(model=model, messages=msgs, stream=True, seed=1)
        except openai.BadRequestError as err:
            seen["streamed seed"] = err
        # harmless fields frameworks send are served
        c.chat.completions.create(
            model=model,
            messages=msgs,
            user="u",
            metadata={"k": "v"},
            store=False,
            stream=False,
            frequency_penalty=0,
            presence_penalty=0.0,
            response_format={"type": "text"},
        )
        return 0.0

    engine = ReplyEngine(tok, tool_reply)
    rows, _ = run(tok, agent, engine)
    assert set(seen) == {*asks, "streamed seed"}
    for name, err in seen.items():
        assert err.param == name.split()[-1], (name, err.param, str(err))
    assert len(engine.calls) == 1 and rows[0]["turns"] == 1


def test_a_template_that_hides_tools_and_a_prompt_past_the_context_are_refused():
    seen = {}

    def agent(sample, *, base_url, api_key, model):
        c = client(base_url, api_key)
        msgs = [{"role": "user", "content": sample["prompt"]}]
        for name, kwargs in {
            "tools": {"tools": [CALC]},
            "context": {"messages": [{"role": "user", "content": "x" * 600}]},
            "after": {},
        }.items():
            try:
                c.chat.completions.create(model=model, **{"messages": msgs, **kwargs})
            except openai.BadRequestError as err:
                seen[name] = str(err)
        return 0.0

    tok = tokenizer(CHAT)
    engine = ReplyEngine(tok, tool_reply)
    rows, metrics = run(tok, agent, engine)
    assert "ignores `tools`" in seen["tools"] and "model.chat_template" in seen["tools"]
    assert re.search(r"prompt of \d+ tokens plus 120 .* context of 512", seen["context"])
    assert "episode has ended (context)" in seen["after"]  # the refusal ended the episode
    assert engine.calls == [] and rows[0]["reward_info"]["end_reason"] == "context"
    assert rows[0]["finish_reason"] == "length" and metrics["rollout/end/context"] == 1.0
