"""OpenEnv environments run unchanged through the agentic loop (env 'openenv'): the same
environment in process and served by OpenEnv's own app over WebSocket plays the same episodes
(tokens, masks, rewards, turns, success), a bad server or a raising env costs only its episode
with a message naming the URL, and bad kwargs or a missing install say what to fix."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest

from tests import needs

needs.module("openenv.core", "pip install --no-deps openenv-core==0.3.0 (docs/openenv.md)")
pytestmark = pytest.mark.integration

from relax_core.envs import resolve_env  # noqa: E402
from relax_core.envs.openenv import INSTALL  # noqa: E402
from relax_core.models.tiny import build_char_tokenizer  # noqa: E402
from relax_core.rollout.engine import SamplingParams  # noqa: E402
from relax_core.rollout.multiturn import EpisodeLimits, run_episodes  # noqa: E402
from relax_core.rollout.observations import ObservationRenderer  # noqa: E402
from tests.integration.openenv_echo import SESSIONS  # noqa: E402
from tests.s3servers import free_ports, log_tail, stop_group  # noqa: E402
from tests.unit.test_multiturn import ScriptedEngine, ids_of  # noqa: E402

ENV = "tests.integration.openenv_echo:GuessEnvironment"
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMITS = EpisodeLimits(max_turns=2, max_episode_tokens=200)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    """OpenEnv's create_app serving the test env under uvicorn on a free loopback port."""
    (port,) = free_ports(1)
    log_path = tmp_path_factory.mktemp("openenv") / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "ENABLE_WEB_INTERFACE"}
    cmd = [sys.executable, "-m", "uvicorn", "tests.integration.openenv_echo:app"]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    log = log_tail(log_path)
                    raise RuntimeError(f"OpenEnv server did not start:\n{log}") from None
                time.sleep(0.1)
        yield url
    finally:
        stop_group(process)


def sample(prompt: str, seed: int) -> dict:
    return {"prompt": prompt, "answer": "", "meta": {"seed": seed}}


def play(tok, factory, scripts: dict[str, list[str]], seeds: dict[str, int]):
    """One episode per prompt; `scripts[prompt]` lists the model's turns (each ended by EOS)."""
    engine = ScriptedEngine(tok, {p: [(t, "stop", 0) for t in ts] for p, ts in scripts.items()})
    samples = [sample(p, seeds[p]) for p in scripts]
    prompts = [ids_of(tok, p) for p in scripts]
    render = ObservationRenderer(tok, "plain")
    params = SamplingParams(max_new_tokens=16)
    return run_episodes(engine, tok, factory, samples, prompts, params, LIMITS, render)


def turn(tok, text: str) -> list[int]:
    return ids_of(tok, text) + [tok.eos_token_id]


def shown(tok, text: str) -> list[int]:
    return ids_of(tok, f"\nuser: {text}\n")


def check_guessing_episodes(tok, episodes) -> None:
    """A (digit 3): 'guess a digit', model 5, 'lower', model 3 -> done, reward 1, correct.
    B (digit 8): 'guess a digit', model 1, 'higher', model 2 -> max_turns, reward 0."""
    a, b = episodes
    greeting = shown(tok, "guess a digit")
    assert a.response_ids == greeting + turn(tok, "5") + shown(tok, "lower") + turn(tok, "3")
    lower = len(shown(tok, "lower"))
    assert a.loss_mask == [0] * len(greeting) + [1, 1] + [0] * lower + [1, 1]
    assert (a.end_reason, a.turns, a.turn_rewards, a.correct) == ("done", 2, [0.0, 1.0], True)
    assert b.response_ids == greeting + turn(tok, "1") + shown(tok, "higher") + turn(tok, "2")
    assert (b.end_reason, b.turns, b.turn_rewards, b.correct) == ("max_turns", 2, [0.0, 0.0], False)


def test_an_openenv_environment_plays_episodes_in_process(tok):
    factory = resolve_env("openenv", env=ENV)
    episodes = play(tok, factory, {"A\n": ["5", "3"], "B\n": ["1", "2"]}, {"A\n": 3, "B\n": 8})
    check_guessing_episodes(tok, episodes)
    # The Observation's metadata is the step's info; the final step also says correct.
    assert episodes[0].turn_info == [{"hit": False}, {"hit": True, "correct": True}]
    assert episodes[1].turn_info == [{"hit": False}, {"hit": False}]


def test_the_served_environment_plays_the_same_episodes_and_frees_its_sessions(tok, server_url):
    factory = resolve_env("openenv", url=server_url)
    scripts, seeds = {"A\n": ["5", "3"], "B\n": ["1", "2"]}, {"A\n": 3, "B\n": 8}
    # Four rounds of two episodes on a server holding 4 sessions: the sessions of finished
    # episodes (done, or cut at max_turns) are given back.
    for _ in range(4):
        episodes = play(tok, factory, scripts, seeds)
        assert [ep.error for ep in episodes] == [None, None]
        check_guessing_episodes(tok, episodes)
    # openenv-core 0.3.0 sends no Observation metadata over the wire.
    assert episodes[0].turn_info == [{}, {"correct": True}]


def test_a_raising_env_on_the_server_ends_only_its_episode(tok, server_url):
    factory = resolve_env("openenv", url=server_url, show_reset="false")
    scripts = {"A\n": ["boom"], "B\n": ["8"]}
    bad, good = play(tok, factory, scripts, {"A\n": 3, "B\n": 8})
    assert bad.end_reason == "env_error" and bad.error.phase == "step"
    assert bad.error.error_type == "OpenEnvServerError"
    assert f"OpenEnv server {server_url}: step failed" in bad.error.message
    assert "the guess blew up" in bad.error.message
    assert (good.end_reason, good.reward, good.correct) == ("done", 1.0, True)
    assert good.response_ids == turn(tok, "8")  # show_reset false: no greeting


def test_episodes_beyond_the_server_s_sessions_fail_alone_saying_why(tok, server_url):
    factory = resolve_env("openenv", url=server_url)
    prompts = [f"{letter}\n" for letter in "ABCDEFG"[: SESSIONS + 1]]
    episodes = play(tok, factory, {p: ["7"] for p in prompts}, dict.fromkeys(prompts, 7))
    assert [ep.end_reason for ep in episodes] == ["done"] * SESSIONS + ["env_error"]
    assert "holds fewer sessions than episodes in flight" in episodes[-1].error.message


def test_an_unreachable_server_costs_the_episode_with_a_message_naming_the_url(tok):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    for kwargs in ({}, {"action_field": "guess", "observation_field": "feedback"}):
        factory = resolve_env("openenv", url=url, **kwargs)  # no network until an episode
        (ep,) = play(tok, factory, {"A\n": ["5"]}, {"A\n": 3})
        assert (ep.end_reason, ep.finish_reason, ep.turns) == ("env_error", "abort", 0)
        assert ep.error.phase == "reset" and ep.error.error_type == "OpenEnvServerError"
        assert ep.error.message.startswith(f"OpenEnv server {url}: ")
        assert "the server is unreachable" in ep.error.message


def test_an_action_builder_and_a_correct_key_read_the_model_s_answer(tok):
    factory = resolve_env(
        "openenv",
        env=ENV,
        env_args='{"greeting": "pick one"}',
        action_builder="tests.integration.openenv_echo:answer_action",
        correct_key="hit",
        success_reward="none",
        role="env",
    )
    (ep,) = play(tok, factory, {"A\n": ["Answer: 4", "Answer: 3"]}, {"A\n": 3})
    pick, lower = ids_of(tok, "\nenv: pick one\n"), ids_of(tok, "\nenv: lower\n")
    assert ep.response_ids == pick + turn(tok, "Answer: 4") + lower + turn(tok, "Answer: 3")
    assert (ep.end_reason, ep.reward, ep.correct) == ("done", 1.0, True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"env": ENV, "colour": "red"}, "unknown key(s) colour"),
        ({"env": ENV, "url": "http://127.0.0.1:1"}, "give exactly one of env"),
        ({"url": "127.0.0.1:8000"}, "env.kwargs.url: expected 'http://host:port'"),
        ({"env": ENV, "show_reset": "maybe"}, "env.kwargs.show_reset: expected true or false"),
        ({"env": ENV, "success_reward": "high"}, "success_reward: expected a number or none"),
        ({"env": ENV, "timeout_s": "0"}, "env.kwargs.timeout_s: must be > 0"),
        ({"env": ENV, "env_args": "{bad"}, "env.kwargs.env_args: not JSON"),
        ({"env": ENV, "env_args": '{"size": 3}'}, "GuessEnvironment cannot take them"),
        ({"env": ENV, "action_field": "answer"}, "GuessAction has no field 'answer'"),
        ({"env": "json:loads"}, "is not an OpenEnv Environment subclass"),
    ],
)
def test_bad_kwargs_stop_the_run_naming_the_kwarg(kwargs, message):
    with pytest.raises(ValueError, match="env.kwargs") as err:
        resolve_env("openenv", **kwargs)
    assert message in str(err.value)


def test_a_correct_key_missing_from_the_wire_says_so(tok, server_url):
    factory = resolve_env("openenv", url=server_url, correct_key="hit")
    (ep,) = play(tok, factory, {"A\n": ["3"]}, {"A\n": 3})
    assert ep.end_reason == "env_error" and "correct_key 'hit'" in ep.error.message
    assert "metadata does not cross the wire" in ep.error.message


def test_without_openenv_core_the_error_gives_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "openenv", None)
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ValueError) as err:
        resolve_env("openenv", url="http://127.0.0.1:8000")
    assert INSTALL in str(err.value)
