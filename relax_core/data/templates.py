"""Prompt rendering: turn a dataset prompt into the text the rollout engine tokenizes.

"plain" feeds the prompt as-is (base models, completion-style tasks such as "12+34=").
"chat" wraps it in the tokenizer's own chat template with the assistant turn opened.
"""

from __future__ import annotations

from typing import Any

TEMPLATES = ("plain", "chat")


def _tokenizer_name(tokenizer: Any) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__


def render_prompt(
    prompt: str, template: str, tokenizer: Any = None, system_prompt: str | None = None
) -> str:
    """Render ``prompt`` with ``template`` (one of TEMPLATES).

    ``tokenizer`` (a Hugging Face tokenizer with a chat template) is needed for "chat" only.
    ``system_prompt`` becomes a system message under "chat"; "plain" rejects it rather than
    inventing a format for it.
    """
    if template not in TEMPLATES:
        raise ValueError(f"unknown prompt template {template!r}; choose one of {TEMPLATES}")
    if template == "plain":
        if system_prompt:
            raise ValueError(
                "system_prompt is only used by the 'chat' template; "
                "put the instruction in the prompt or use template 'chat'"
            )
        return prompt
    if tokenizer is None:
        raise ValueError("prompt template 'chat' needs a tokenizer")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {_tokenizer_name(tokenizer)!r} has no chat template; "
            "use prompt template 'plain' or a tokenizer/model that ships one"
        )
    messages = [{"role": "user", "content": prompt}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
