"""What SGLang 0.5.23 refuses of a run's rollout settings, checked before anything starts.

- a `/generate` call whose prompt plus `max_new_tokens` passes the server's context is refused
  whole (TokenizerManager._validate_one_request), and a prompt needs at least one token: a
  `--context-length` in `sglang.extra_args` at or below `rollout.max_new_tokens` refuses every
  batch. (Without it the context is the model's; the rollout engine reads it from the policy's
  config.json and refuses a batch that cannot fit before sending it.)
"""

from __future__ import annotations

import shlex


def context_length_arg(extra_args: str) -> int | None:
    """`--context-length N` (or `=N`) of SGLang's extra arguments; None when absent."""
    args = shlex.split(extra_args)
    for i, arg in enumerate(args):
        value = args[i + 1] if arg == "--context-length" and i + 1 < len(args) else None
        if arg.startswith("--context-length="):
            value = arg.split("=", 1)[1]
        if value is not None:
            return int(value) if value.isdigit() else None
    return None


def check_sglang_context(e: list[str], cfg) -> None:
    context = context_length_arg(cfg.sglang.extra_args)
    if context is not None and cfg.rollout.max_new_tokens >= context:
        e.append(
            f"rollout.max_new_tokens: {cfg.rollout.max_new_tokens} leaves no room for a prompt "
            f"in the SGLang server's context of {context} tokens (--context-length in "
            "sglang.extra_args): SGLang refuses every batch; lower rollout.max_new_tokens or "
            "raise --context-length"
        )
