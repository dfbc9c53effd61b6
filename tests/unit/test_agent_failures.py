"""A run whose agents all fail stops: through the real AgentRunner and endpoint, a step whose every
episode was refused (HTTP 400) or crashed counts, `env.max_failed_agent_steps` of them in a row
raise AgentsFailed naming the first agent error and the setting, one episode that ran resets the
count, and a held-out eval whose every episode failed raises at once."""

from __future__ import annotations

import re
from pathlib import Path

import openai
import pytest

from relax_core.agents.server import CallLimits
from relax_core.config import ConfigError, load_config, replace
from relax_core.data.prompts import PromptItem
from relax_core.models.tiny import build_char_tokenizer
from relax_core.queue import rows_to_table
from relax_core.roles.agents import AgentRunner
from relax_core.roles.episodes import env_runner
from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.train.agent_failures import (
    AgentsFailed,
    count_failed_step,
    failed_step_error,
    first_failure,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CHAT = (
    "{%- for m in messages -%}{{ m['role'] }}: {{ m['content'] }}</s>\n{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant: {% endif -%}"
)
PARAMS = SamplingParams(max_new_tokens=8)
REFUSAL = "one choice per call"  # the endpoint's 400 for n=2


class EchoEngine:
    """Answers every prompt with 'ok' and EOS."""

    version = 0

    def __init__(self, tok) -> None:
        self.ids = tok("ok", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]

    def generate(self, prompts, params, media=None):
        return [Completion(list(self.ids), [-0.1] * len(self.ids), "stop", 0) for _ in prompts]


def agent(sample, *, base_url, api_key, model):
    """Refused (n=2) on prompts ending in 'r', crashes on 'c', plays one call otherwise."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": sample["prompt"]}]
    kind = sample["prompt"][-1]
    if kind == "c":
        raise ValueError("the tool server is down")
    client.chat.completions.create(model=model, messages=messages, n=2 if kind == "r" else 1)
    return 1.0


@pytest.fixture
def runner():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT
    agents = AgentRunner(agent, tok, CallLimits(2, 64, 8), workers=4, timeout_s=30.0)
    yield agents, EchoEngine(tok)
    agents.close()


def _items(agents, kinds: str) -> list[PromptItem]:
    rows = [{"prompt": f"task {i} {k}", "answer": "", "meta": {}} for i, k in enumerate(kinds)]
    ids = [agents.tokenizer(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows]
    return [PromptItem(0, i, r, p) for i, (r, p) in enumerate(zip(rows, ids, strict=True))]


def _step_error(agents, engine, kinds: str) -> str | None:
    """The first agent error of a step whose prompts end in `kinds` (None: one did not fail),
    read as the colocate controller reads its rows and the async trainer its table."""
    rows, _ = agents.rollout(engine, _items(agents, kinds), PARAMS, 2)
    error = first_failure(row["reward_info"] for row in rows)
    assert failed_step_error(rows_to_table(rows).column("reward_info").to_pylist()) == error
    return error


def test_failed_steps_in_a_row_stop_the_run_with_the_first_agent_error(runner):
    agents, engine = runner
    count = count_failed_step(0, _step_error(agents, engine, "rc"), limit=2)
    assert count == 1
    # A step where one episode ran trains it: the count starts again.
    assert count_failed_step(count, _step_error(agents, engine, "rr-"), limit=2) == 0
    count = count_failed_step(0, _step_error(agents, engine, "rr"), limit=2)
    error = _step_error(agents, engine, "cr")
    with pytest.raises(AgentsFailed) as failed:
        count_failed_step(count, error, limit=2)
    message = str(failed.value)
    assert "every agent episode failed in 2 steps in a row (env.max_failed_agent_steps: 2)" in (
        message
    )
    # The step's first episode crashed; its message is the one named.
    assert message.endswith("ValueError: the tool server is down")
    assert count_failed_step(10, error, limit=0) == 11  # 0: never stops


def test_the_first_error_named_is_what_the_agents_exception_carried(runner):
    agents, engine = runner
    error = _step_error(agents, engine, "rc")
    assert error.startswith("BadRequestError: Error code: 400") and REFUSAL in error


def test_a_held_out_eval_whose_every_episode_failed_stops_at_once(runner):
    agents, engine = runner
    source = type("Source", (), {"rows": [{"prompt": "q r", "answer": "", "meta": {}}] * 2})()
    with pytest.raises(AgentsFailed, match=r"held-out eval failed \(2 of 2\).*" + REFUSAL):
        agents.evaluate(engine, source, 8)
    mixed = type("Source", (), {"rows": [{"prompt": p, "answer": "", "meta": {}} for p in "r-"]})()
    assert agents.evaluate(engine, mixed, 8)["eval/agent_errors"] == 1.0
    agents.stop_when_eval_fails = False
    assert agents.evaluate(engine, source, 8)["eval/agent_errors"] == 2.0


def test_the_setting_is_validated_and_zero_turns_the_eval_check_off():
    cfg = load_config(str(Path(__file__).resolve().parents[2] / "configs" / "cpu-agent.yaml"))
    assert cfg.env.max_failed_agent_steps == 2
    with pytest.raises(ConfigError, match=re.escape("env.max_failed_agent_steps: must be >= 0")):
        replace(cfg, env={"max_failed_agent_steps": -1})
    off = replace(cfg, env={"max_failed_agent_steps": 0})
    assert not env_runner(off, None, build_char_tokenizer()).stop_when_eval_fails


def test_rows_that_are_not_agent_episodes_never_count():
    assert first_failure([{"correct": False}, {"end_reason": "agent_error"}]) is None
    assert first_failure([{"end_reason": "env_error", "env_error": "x"}]) is None
    assert first_failure([]) is None
    assert first_failure([{"end_reason": "timeout"}]) == "the episode ended in timeout"
