"""The RolloutEngine protocol: what the rollout role needs from any generation engine.

Implementations: `TorchEngine` (HF transformers model in process; CPU default and tests),
`SGLangEngine` (an SGLang server over HTTP: sglang_engine.py, started by sglang_server.py) and
`ColocatedSGLang` (the same server taking turns with the trainer on shared GPUs:
sglang_colocate.py). Engines generate from token ids and return token ids, so the tokenizer and
chat template stay in one place (the rollout role) whatever serves the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    """Generation budget; a response that reaches it ends with finish_reason 'length'."""
    temperature: float = 1.0
    """Logits are divided by this before sampling; log-probs are of the scaled distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    greedy: bool = False
    """Take the arg-max token (evaluation); log-probs are still reported."""


@dataclass(frozen=True)
class Completion:
    response_ids: list[int]
    """Generated token ids, including the EOS token when generation stopped on it."""
    logprobs: list[float]
    """Log-probability of each generated token under the sampling distribution."""
    finish_reason: str
    """'stop' (EOS), 'length' (budget reached) or 'abort'."""
    policy_version: int
    """Version of the weights that generated the first token of this completion."""
    policy_version_max: int | None = None
    """Version that generated the last token, when a weight update landed mid-generation
    (partial rollout); None = every token came from `policy_version`."""
    routed_experts: list[list[int]] | None = None
    """MoE routing replay: the experts each token of prompt + response but the last was routed
    to (len(prompt) + len(response) - 1 lists of num_layers * top_k ints, layer-major), as
    SGLang's `routed_experts` reports them; None when the engine was not asked for them."""


class RolloutEngine(Protocol):
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order."""
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load new weights (all or a bucket of them); the version applies once all are in."""
        ...

    def pause(self) -> None:
        """Stop taking new generation work (weights are about to change)."""
        ...

    def resume(self) -> None:
        """Take generation work again."""
        ...

    def health(self) -> dict[str, object]:
        """Liveness and the policy version served."""
        ...


MAX_ABORT_RETRIES = 8
"""How many times in a row a server engine asks again for samples a pause aborted."""


def without_aborts(
    count: int,
    attempt: Callable[[list[int]], list[Completion]],
    refused: Callable[[int], Exception],
) -> tuple[list[Completion], int]:
    """Completions of prompts 0..count-1, none cut by an abort pause: `attempt(indices)` returns
    the completions of those prompts in order, and the aborted ones (finish_reason 'abort') are
    asked for again, up to MAX_ABORT_RETRIES times, then `refused(still aborted)` is raised.
    Returns (completions in prompt order, samples asked for again)."""
    out: list[Completion | None] = [None] * count
    todo, again = list(range(count)), 0
    for _ in range(MAX_ABORT_RETRIES + 1):
        aborted = []
        for i, completion in zip(todo, attempt(todo), strict=True):
            if completion.finish_reason == "abort":
                aborted.append(i)
            else:
                out[i] = completion
        if not aborted:
            return [c for c in out if c is not None], again
        again += len(aborted)
        todo = aborted
    raise refused(len(todo))
