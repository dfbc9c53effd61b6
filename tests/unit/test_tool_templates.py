"""The shipped chat templates that render tools (configs/templates/): without tools they render
as before (tiny-chat as it always has, smollm2-tools as SmolLM2-Instruct's own template), with
tools the schemas go into the system turn and an assistant's tool_calls become <tool_call> JSON
blocks, and the endpoint's continuation of a tool turn after a tool-call reply is exactly what a
full render adds after that reply's end-of-turn token (the engine's tokens are extended, never
re-rendered)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from relax_core.models.tiny import CHARSET, build_char_tokenizer
from relax_core.rollout.observations import continuation_text

TEMPLATES = Path(__file__).resolve().parents[2] / "configs" / "templates"
# configs/templates/tiny-chat.jinja before it rendered tools: the runs and tests that use it
# depend on these bytes.
TINY_CHAT_BEFORE = (
    "{%- for message in messages -%}\n{{ message['role'] }}: {{ message['content'] }}</s>\n"
    "{% endfor -%}\n{%- if add_generation_prompt -%}assistant: {% endif -%}\n"
)
# SmolLM2-135M-Instruct's own template (its GGUF's tokenizer.chat_template).
SMOLLM2_OWN = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
JSON_CHARS = '<>_{}[]"|'  # what tool calls and schemas are written with, beyond the tiny charset
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "calculator", "arguments": '{"expression": "661*14"}'},
}
PLAIN = [
    [{"role": "user", "content": "What is 661*14?\n"}],
    [
        {"role": "system", "content": "You have a calculator."},
        {"role": "user", "content": "What is 661*14?"},
        {"role": "assistant", "content": "calc(661*14)"},
        {"role": "tool", "content": "9254"},
        {"role": "assistant", "content": "Answer: 9254"},
    ],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}],
]


def _chatml_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, plus ChatML's <|im_start|> and <|im_end|> (the end of turn)."""
    specials = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(CHARSET + JSON_CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )


def _tokenizer(name: str):
    tok = (
        _chatml_tokenizer()
        if name == "smollm2-tools"
        else build_char_tokenizer(CHARSET + JSON_CHARS)
    )
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return tok


def _render(tok, messages, generation: bool, tools=None, template=None) -> str:
    extra = {"tools": tools} if tools else {}
    if template is not None:
        extra["chat_template"] = template
    return tok.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, **extra
    )


@pytest.mark.parametrize(
    ("name", "before"),
    [("tiny-chat", TINY_CHAT_BEFORE), ("smollm2-tools", SMOLLM2_OWN)],
    ids=["tiny-chat", "smollm2-tools"],
)
def test_without_tools_a_template_renders_as_before(name, before):
    tok = _tokenizer(name)
    for messages in PLAIN:
        for generation in (False, True):
            expected = _render(tok, messages, generation, template=before)
            assert _render(tok, messages, generation) == expected


@pytest.mark.parametrize("name", ["tiny-chat", "smollm2-tools"])
def test_tools_and_tool_calls_are_rendered_hermes_style(name):
    tok = _tokenizer(name)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 661*14?"},
        {"role": "assistant", "content": "Let me compute.", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "9254"},
    ]
    text = _render(tok, messages, True, TOOLS)
    system = text[: text.index(tok.eos_token)]
    assert "Be brief." in system  # the system message opens the tools turn
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in system
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in system
    assert text.count("Be brief.") == 1
    # The reply: its content, then the call as the model is asked to write it.
    call = (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "661*14"}}\n</tool_call>'
    )
    assert f"Let me compute.\n{call}{tok.eos_token}" in text
    # Arguments given as a dict (not OpenAI's JSON string) render the same.
    as_dict = {"function": {"name": "calculator", "arguments": {"expression": "661*14"}}}
    no_content = [messages[1], {"role": "assistant", "tool_calls": [as_dict, CALL]}]
    twice = _render(tok, no_content, False, TOOLS)
    assert f"{call}\n{call}{tok.eos_token}" in twice and "None" not in twice
    assert "9254" in text.split(call)[1]  # the tool turn follows the call


@pytest.mark.parametrize("name", ["tiny-chat", "smollm2-tools"])
def test_a_tool_turn_continues_a_tool_call_reply_as_the_full_render_does(name):
    tok = _tokenizer(name)
    history = [
        {"role": "user", "content": "What is 661*14?"},
        {"role": "assistant", "tool_calls": [CALL]},
    ]
    result = [{"role": "tool", "tool_call_id": "call_1", "content": "9254"}]
    # What the engine holds after the reply: the render through its end-of-turn token.
    rendered = _render(tok, history, False, TOOLS)
    held = rendered[: rendered.rindex(tok.eos_token) + len(tok.eos_token)]
    full = _render(tok, history + result, True, TOOLS)
    assert held + continuation_text(tok, result, TOOLS) == full
    ids = tok(held, add_special_tokens=False)["input_ids"]
    ids += tok(continuation_text(tok, result, TOOLS), add_special_tokens=False)["input_ids"]
    assert ids == tok(full, add_special_tokens=False)["input_ids"]
