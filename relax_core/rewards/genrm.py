"""The "genrm" reward: a language model judges each response against the reference answer.

Parts: a RolloutEngine serving the judge model (`TorchEngine` on CPU; an SGLang client on a
cluster), the judge's tokenizer, a prompt template, and `parse_verdict`. Per batch of
`judge_batch_size` samples the judge prompt is rendered through the tokenizer's chat template with
the assistant turn opened by "Verdict:", generated greedily, and the verdict read from the reply:
"correct" scores 1, "incorrect" 0. A batch whose engine call raises or outlasts `judge_timeout_s`,
and a reply with no readable verdict, cost their samples (reward 0, `info["error"]`, counted in
`metrics()`), never the run.

The timeout bounds how long scoring waits, not the engine's work: an in-process engine cannot be
interrupted, so a call given up on finishes in the background, and the next call waits for it
within its own timeout (engine calls never overlap).
"""

from __future__ import annotations

import re
import string
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from relax_core.config import RewardConfig
from relax_core.data.templates import render_prompt
from relax_core.rewards.extract import clip
from relax_core.rewards.result import RewardResult
from relax_core.rollout.engine import Completion, RolloutEngine, SamplingParams

DEFAULT_TEMPLATE = (
    "You are grading a student's answer to a question.\n\n"
    "Question:\n{question}\n\n"
    "Reference answer:\n{reference}\n\n"
    "Student response:\n{response}\n\n"
    "Does the student's final answer agree with the reference answer? "
    "Reply with one line: 'Verdict: correct' or 'Verdict: incorrect'."
)
TEMPLATE_FIELDS = frozenset({"question", "response", "reference"})
VERDICT_PREFIX = "Verdict:"
"""Opens the judge's reply, so its first generated tokens are the verdict itself."""

_POSITIVE = frozenset({"correct", "right", "accurate", "valid", "pass", "passed"})
_NEGATIVE = frozenset({"incorrect", "wrong", "inaccurate", "invalid", "fail", "failed"})
# Only trusted as the very first word of the verdict: later in a sentence "no" or "true" are
# too often part of the explanation ("no errors", "it is true that ...").
_DIRECT = {"yes": True, "true": True, "1": True, "no": False, "false": False, "0": False}
_NEGATIONS = frozenset({"not", "isnt", "never"})
_TAG = re.compile(r"verdict\s*[:=\-]", re.IGNORECASE)
_WORD = re.compile(r"[a-z0-9]+|/")


def parse_verdict(text: str) -> bool | None:
    """True (correct), False (incorrect) or None (no readable verdict) from a judge's reply.

    Read from the first "Verdict:" tag if there is one, else from the start: the first verdict
    word decides, case and punctuation ignored ("**Correct.**", "INCORRECT!"); "not correct" is
    incorrect and "not wrong" correct; yes/no, true/false and 1/0 count only as the first word; an echoed choice such as
    "correct or incorrect" or "correct/incorrect" is no verdict.
    """
    tag = _TAG.search(text)
    region = text[tag.end() :] if tag else text
    words = _WORD.findall(region.lower().replace("'", ""))
    if words and words[0] in _DIRECT:
        return _DIRECT[words[0]]
    for i, word in enumerate(words):
        if word in _POSITIVE or word in _NEGATIVE:
            verdict = word in _POSITIVE
            if i > 0 and words[i - 1] in _NEGATIONS:
                verdict = not verdict
            rest = words[i + 1 : i + 3]
            if len(rest) == 2 and rest[0] in ("or", "/") and rest[1] in (_POSITIVE | _NEGATIVE):
                return None
            return verdict
    return None


def check_template(template: str) -> str:
    """`template` itself, or the built-in one for ""; raises ValueError naming
    `reward.judge_template` if it uses a field other than {question}, {response}, {reference}
    or lacks {response}."""
    if not template:
        return DEFAULT_TEMPLATE
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        raise ValueError(f"reward.judge_template: {e} (write a literal brace as '{{{{')") from e
    unknown = fields - TEMPLATE_FIELDS
    if unknown:
        raise ValueError(
            f"reward.judge_template: unknown field(s) {sorted(unknown)}; "
            f"allowed: {{question}}, {{response}}, {{reference}}"
        )
    if "response" not in fields:
        raise ValueError("reward.judge_template: must contain {response}, the text being judged")
    return template


@dataclass
class JudgeStats:
    """Cumulative counts of one judge's work."""

    calls: int = 0
    """Engine calls (one per batch of up to judge_batch_size samples)."""
    samples: int = 0
    """Samples sent to the judge."""
    failures: int = 0
    """Samples that got no verdict: engine error, timeout, or an unreadable reply."""
    latency_s: float = 0.0
    """Wall time of all engine calls together (a timed-out call counts as judge_timeout_s)."""


class JudgeTimeout(TimeoutError):
    """The judge engine did not answer within judge_timeout_s."""


class GenRMJudge:
    """A batch reward (`score_many`) backed by a judge model; also callable per sample."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        template: str = "",
        max_new_tokens: int = 8,
        batch_size: int = 16,
        timeout_s: float = 120.0,
    ) -> None:
        for name, value in (
            ("judge_max_new_tokens", max_new_tokens),
            ("judge_batch_size", batch_size),
            ("judge_timeout_s", timeout_s),
        ):
            if not value > 0:
                raise ValueError(f"reward.{name}: must be > 0, got {value}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.template = check_template(template)
        render_prompt("", "chat", tokenizer)  # a judge tokenizer without a chat template fails here
        self.params = SamplingParams(max_new_tokens=max_new_tokens, greedy=True)
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.stats = JudgeStats()
        self._reported = JudgeStats()
        self._stats_lock = threading.Lock()
        self._engine_lock = threading.Lock()

    # ------------------------------------------------------------------ scoring
    def __call__(self, response: str, answer: str, sample: Mapping[str, Any], /) -> RewardResult:
        return self.score_many([response], [answer], [sample])[0]

    def score_many(
        self,
        responses: Sequence[str],
        answers: Sequence[str],
        samples: Sequence[Mapping[str, Any]],
        /,
    ) -> list[RewardResult]:
        """One result per response, judged in ceil(n / batch_size) engine calls."""
        prompts = [
            self.judge_prompt_ids(r, a, s)
            for r, a, s in zip(responses, answers, samples, strict=True)
        ]
        results: list[RewardResult] = []
        for start in range(0, len(prompts), self.batch_size):
            results.extend(self._judge_batch(prompts[start : start + self.batch_size]))
        return results

    def judge_prompt(self, response: str, answer: str, sample: Mapping[str, Any]) -> str:
        """The text the judge continues: the filled template as a user turn, then the opened
        assistant turn starting with "Verdict:"."""
        question = str(sample.get("prompt", ""))
        user = self.template.format(question=question, response=response, reference=answer)
        return render_prompt(user, "chat", self.tokenizer) + VERDICT_PREFIX

    def judge_prompt_ids(self, response: str, answer: str, sample: Mapping[str, Any]) -> list[int]:
        text = self.judge_prompt(response, answer, sample)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _judge_batch(self, prompts: list[list[int]]) -> list[RewardResult]:
        t0 = time.perf_counter()
        try:
            completions = self._generate(prompts)
            error = None
        except Exception as e:  # noqa: BLE001 - a judge failure costs its samples, not the run
            completions, error = [], f"{type(e).__name__}: {e}"
        latency = time.perf_counter() - t0
        if error is not None:
            results = [
                RewardResult(0.0, False, {"error": error, "judge_latency_s": latency})
                for _ in prompts
            ]
        else:
            results = [self._result(c, latency) for c in completions]
        with self._stats_lock:
            self.stats.calls += 1
            self.stats.samples += len(prompts)
            self.stats.failures += sum("error" in r.info for r in results)
            self.stats.latency_s += latency
        return results

    def _generate(self, prompts: list[list[int]]) -> list[Completion]:
        """`engine.generate` on a worker thread, waited on for at most timeout_s."""
        box: dict[str, Any] = {}

        def work() -> None:
            with self._engine_lock:
                try:
                    box["completions"] = self.engine.generate(prompts, self.params)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                    box["error"] = e

        worker = threading.Thread(target=work, name="genrm-judge", daemon=True)
        worker.start()
        worker.join(self.timeout_s)
        if worker.is_alive():
            raise JudgeTimeout(
                f"judge gave no answer within judge_timeout_s={self.timeout_s:g} "
                f"({len(prompts)} samples)"
            )
        if "error" in box:
            raise box["error"]
        completions = box["completions"]
        if len(completions) != len(prompts):
            raise RuntimeError(
                f"judge engine returned {len(completions)} completions for {len(prompts)} prompts"
            )
        return completions

    def _result(self, completion: Completion, latency: float) -> RewardResult:
        reply = self.tokenizer.decode(completion.response_ids, skip_special_tokens=True)
        text = VERDICT_PREFIX + reply
        info: dict[str, Any] = {"judge_text": clip(text), "judge_latency_s": latency}
        verdict = parse_verdict(text)
        if verdict is None:
            return RewardResult(0.0, False, {"error": "judge reply has no verdict", **info})
        info["verdict"] = "correct" if verdict else "incorrect"
        return RewardResult(1.0 if verdict else 0.0, verdict, info)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float]:
        """The judge's work since the previous `metrics()` call (so each logged step shows its
        own): engine calls, failed samples, mean seconds per call. `stats` stays cumulative."""
        with self._stats_lock:
            now, before = self.stats, self._reported
            calls = now.calls - before.calls
            latency = now.latency_s - before.latency_s
            out = {
                "reward/judge_calls": float(calls),
                "reward/judge_failures": float(now.failures - before.failures),
                "reward/judge_latency_s": latency / calls if calls else 0.0,
            }
            self._reported = JudgeStats(now.calls, now.samples, now.failures, now.latency_s)
        return out


def build_genrm_judge(
    cfg: RewardConfig, cache_dir: str | None = None, dtype: str = "float32", seed: int = 0
) -> GenRMJudge:
    """Load the judge model named by `cfg.judge_source` into a TorchEngine. With `cache_dir` a
    GGUF source is converted once into a safetensors directory there (the policy's converted copy
    is reused when both name the same file); without it the GGUF is dequantized on every load."""
    import torch

    from relax_core.models.policy import load_policy
    from relax_core.models.pretrained import load_pretrained, materialize
    from relax_core.rollout.torch_engine import TorchEngine

    check_template(cfg.judge_template)  # fail before tens of seconds of loading
    if cache_dir:
        model, tokenizer = load_policy(materialize(cfg.judge_source, cache_dir), dtype)
    else:
        model, tokenizer = load_pretrained(cfg.judge_source)
        model = model.to(getattr(torch, dtype))
    model.requires_grad_(False)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    engine = TorchEngine(
        model, tokenizer.eos_token_id, pad, seed=seed, max_batch_size=cfg.judge_batch_size
    )
    return GenRMJudge(
        engine,
        tokenizer,
        template=cfg.judge_template,
        max_new_tokens=cfg.judge_max_new_tokens,
        batch_size=cfg.judge_batch_size,
        timeout_s=cfg.judge_timeout_s,
    )
