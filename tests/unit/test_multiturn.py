"""Multi-turn agent loop: token layout and loss masks across turns, every way an episode ends,
env failures confined to their episode, observations in chat templates and with media, the real
torch engine, and zero gradient from observation tokens under every policy loss."""

from __future__ import annotations

import pytest
import torch

from relax_core.algorithms import POLICY_LOSSES, LossInputs, LossSettings
from relax_core.config import ModelConfig
from relax_core.data.templates import render_prompt
from relax_core.envs import resolve_env
from relax_core.models.tiny import build_char_tokenizer, build_tiny_qwen3
from relax_core.queue import rows_to_table
from relax_core.rollout.demonstrations import demonstration_episode
from relax_core.rollout.engine import Completion, SamplingParams
from relax_core.rollout.multiturn import (
    END_REASONS,
    EpisodeLimits,
    episode_metrics,
    run_episodes,
)
from relax_core.rollout.observations import ObservationRenderer
from relax_core.rollout.torch_engine import TorchEngine
from relax_core.train.batch import make_micro_batch
from relax_core.train.torch_backend import response_logprobs

SMALL = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64)
LIMITS = EpisodeLimits(max_turns=6, max_episode_tokens=200)
PARAMS = SamplingParams(max_new_tokens=16)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def lp_of(token: int) -> float:
    """The log-prob the scripted engine reports for a token: distinct per token, easy to check."""
    return -token / 100


class ScriptedEngine:
    """Plays predetermined turns: `scripts[prompt text]` lists the (text, finish, version) turns
    of the episode with that prompt; a 'stop' turn gets EOS appended, as an engine would.
    Honours `max_new_tokens` like a real engine and records every call."""

    def __init__(self, tok, scripts: dict[str, list[tuple[str, str, int]]]) -> None:
        self.tok, self.calls = tok, []
        self.scripts = {tuple(ids_of(tok, p)): list(turns) for p, turns in scripts.items()}

    def generate(self, prompts, params, media=None):
        self.calls.append({"prompts": prompts, "cap": params.max_new_tokens, "media": media})
        out = []
        for prompt in prompts:
            key = next(k for k in self.scripts if tuple(prompt[: len(k)]) == k)
            text, finish, version = self.scripts[key].pop(0)
            ids = ids_of(self.tok, text) + ([self.tok.eos_token_id] if finish == "stop" else [])
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            out.append(Completion(ids, [lp_of(t) for t in ids], finish, version))
        return out


class ScriptEnv:
    """Observation f"obs{t}" after turn t; the row's meta says when it is done and how it fails."""

    def reset(self, sample):
        self.meta, self.t, self.seen = sample["meta"], 0, []
        if self.meta.get("fail") == "reset":
            raise KeyError("no such level")
        return self.meta.get("initial")

    def step(self, action_text):
        self.t += 1
        self.seen.append(action_text)
        if self.meta.get("fail") == "step" and self.t == 2:
            raise ZeroDivisionError("env bug on turn 2")
        if self.meta.get("fail") == "malformed":
            return ("obs", 1.0)
        done = self.t == self.meta.get("done_after", 0)
        info = {"t": self.t, "correct": done, "tool_call_valid": self.t % 2 == 1}
        return (f"obs{self.t}", 0.5, done, info)

    def format_observation(self, observation):
        if self.meta.get("fail") == "format":
            raise ValueError("cannot show that")
        return {"role": "env", "content": str(observation), "media": self.meta.get("media")}


def sample(prompt: str, **meta) -> dict:
    return {"prompt": prompt, "answer": "", "meta": meta}


def play(tok, scripts, samples, limits=LIMITS, params=PARAMS, render=None, media=None):
    engine = ScriptedEngine(tok, scripts)
    prompts = [ids_of(tok, s["prompt"]) for s in samples]
    render = render or ObservationRenderer(tok, "plain")
    episodes = run_episodes(engine, tok, ScriptEnv, samples, prompts, params, limits, render, media)
    return episodes, engine


def obs_ids(tok, t: int) -> list[int]:
    return ids_of(tok, f"\nenv: obs{t}\n")


# ---------------------------------------------------------------------------- layout and masks


def test_loss_mask_covers_exactly_the_model_tokens_across_turns(tok):
    scripts = {"P\n": [("ab", "stop", 0), ("cde", "stop", 0), ("f", "stop", 0)]}
    (ep,), engine = play(tok, scripts, [sample("P\n", done_after=3)])
    eos = tok.eos_token_id
    t1, t2, t3 = ids_of(tok, "ab") + [eos], ids_of(tok, "cde") + [eos], ids_of(tok, "f") + [eos]
    # The transcript by hand: turn, observation, turn, observation, turn.
    expected = t1 + obs_ids(tok, 1) + t2 + obs_ids(tok, 2) + t3
    mask = [1] * len(t1) + [0] * len(obs_ids(tok, 1)) + [1] * len(t2)
    mask += [0] * len(obs_ids(tok, 2)) + [1] * len(t3)
    assert ep.response_ids == expected
    assert ep.loss_mask == mask
    for token, m, lp in zip(ep.response_ids, ep.loss_mask, ep.rollout_logprobs, strict=True):
        assert lp == (lp_of(token) if m else 0.0)
    # Each turn is generated from the prompt plus everything so far: the trainer's sequence.
    prompt = ids_of(tok, "P\n")
    assert [c["prompts"][0] for c in engine.calls] == [
        prompt,
        prompt + t1 + obs_ids(tok, 1),
        prompt + t1 + obs_ids(tok, 1) + t2 + obs_ids(tok, 2),
    ]
    assert (ep.turns, ep.end_reason, ep.finish_reason) == (3, "done", "stop")
    assert ep.turn_rewards == [0.5, 0.5, 0.5] and ep.reward == 1.5 and ep.correct
    assert (ep.tool_calls, ep.tool_calls_valid) == (3, 2)


def test_live_episodes_share_one_generate_call_per_turn(tok):
    scripts = {f"{k}\n": [("x", "stop", 0)] * 3 for k in "ABC"}
    samples = [sample(f"{k}\n", done_after=n) for k, n in zip("ABC", (1, 3, 2), strict=True)]
    episodes, engine = play(tok, scripts, samples)
    assert [len(c["prompts"]) for c in engine.calls] == [3, 2, 1]
    assert [ep.turns for ep in episodes] == [1, 3, 2]  # results stay in input order


def test_the_env_sees_each_turn_without_special_tokens(tok):
    env_texts = []

    class Recording(ScriptEnv):
        def step(self, action_text):
            env_texts.append(action_text)
            return super().step(action_text)

    engine = ScriptedEngine(tok, {"P\n": [("12 ab", "stop", 0)]})
    run_episodes(
        engine,
        tok,
        Recording,
        [sample("P\n", done_after=1)],
        [ids_of(tok, "P\n")],
        PARAMS,
        LIMITS,
        ObservationRenderer(tok, "plain"),
    )
    assert env_texts == ["12 ab"]


def test_an_initial_observation_precedes_the_first_turn(tok):
    scripts = {"P\n": [("a", "stop", 0)]}
    (ep,), _ = play(tok, scripts, [sample("P\n", done_after=1, initial="hi")])
    first = ids_of(tok, "\nenv: hi\n")
    assert ep.response_ids[: len(first)] == first
    assert ep.loss_mask == [0] * len(first) + [1, 1]


# ---------------------------------------------------------------------------- how episodes end


def test_max_turns_ends_without_a_trailing_observation(tok):
    scripts = {"P\n": [("ab", "stop", 0)] * 5}
    (ep,), engine = play(tok, scripts, [sample("P\n")], EpisodeLimits(3, 200))
    assert (ep.turns, ep.end_reason, ep.finish_reason) == (3, "max_turns", "stop")
    assert ep.response_ids[-1] == tok.eos_token_id and ep.loss_mask[-1] == 1
    assert len(engine.calls) == 3 and not ep.correct


def test_a_turn_cut_by_the_token_budget_marks_the_row_truncated(tok):
    t1 = len(ids_of(tok, "abcdef")) + 1  # 7 with EOS
    budget = t1 + len(obs_ids(tok, 1)) + 3  # room for 3 tokens of turn 2
    scripts = {"P\n": [("abcdef", "stop", 0), ("ghijkl", "stop", 0)]}
    (ep,), engine = play(tok, scripts, [sample("P\n")], EpisodeLimits(6, budget))
    assert len(ep.response_ids) == budget
    assert ep.response_ids[-3:] == ids_of(tok, "ghi") and ep.loss_mask[-3:] == [1, 1, 1]
    assert (ep.end_reason, ep.finish_reason, ep.turns) == ("token_budget", "length", 2)
    assert engine.calls[1]["cap"] == 3
    assert len(ep.turn_rewards) == 1  # the cut turn is never shown to the env


def test_an_observation_that_does_not_fit_ends_the_episode(tok):
    budget = 7 + len(obs_ids(tok, 1))  # the observation fits, one more model token does not
    scripts = {"P\n": [("abcdef", "stop", 0)]}
    (ep,), _ = play(tok, scripts, [sample("P\n")], EpisodeLimits(6, budget))
    assert len(ep.response_ids) == 7 and ep.loss_mask == [1] * 7
    assert (ep.end_reason, ep.finish_reason) == ("token_budget", "length")


def test_the_batch_cap_is_cut_per_episode(tok):
    # A's budget leaves 2 tokens in turn 2; B's leaves 16: one call with cap 16, A's turn cut.
    budget_a = 2 + len(obs_ids(tok, 1)) + 2
    scripts = {"A\n": [("a", "stop", 0), ("bbbbb", "stop", 0)], "B\n": [("a", "stop", 0)] * 2}
    engine = ScriptedEngine(tok, scripts)
    render = ObservationRenderer(tok, "plain")
    a, b = (
        run_episodes(engine, tok, ScriptEnv, [sample(p)], [ids_of(tok, p)], PARAMS, lim, render)[0]
        for p, lim in (("A\n", EpisodeLimits(6, budget_a)), ("B\n", EpisodeLimits(2, 200)))
    )
    assert len(a.response_ids) == budget_a and a.end_reason == "token_budget"
    assert b.end_reason == "max_turns"


def test_a_turn_without_eos_at_the_per_turn_cap_is_truncated(tok):
    scripts = {"P\n": [("abcdefgh", "stop", 0)]}
    (ep,), _ = play(tok, scripts, [sample("P\n")], params=SamplingParams(max_new_tokens=4))
    assert ep.response_ids == ids_of(tok, "abcd")
    assert (ep.end_reason, ep.finish_reason, ep.turn_rewards) == ("turn_length", "length", [])


def test_an_engine_abort_ends_the_episode(tok):
    (ep,), _ = play(tok, {"P\n": [("ab", "abort", 0)]}, [sample("P\n")])
    assert (ep.end_reason, ep.finish_reason, ep.turns) == ("engine_abort", "abort", 1)


def test_eos_closes_the_turn_and_the_env_decides_the_episode_ends(tok):
    engine = ScriptedEngine(
        tok, {"What is 12*3?\n": [("calc(12*3)", "stop", 0), ("Answer: 36", "stop", 0)]}
    )
    row = {"prompt": "What is 12*3?\n", "answer": "36"}
    (ep,) = run_episodes(
        engine,
        tok,
        resolve_env("calculator"),
        [row],
        [ids_of(tok, row["prompt"])],
        PARAMS,
        LIMITS,
        ObservationRenderer(tok, "plain"),
    )
    assert tok.decode(ep.response_ids) == "calc(12*3)</s>\ntool: 36\nAnswer: 36</s>"
    assert (ep.end_reason, ep.correct, ep.reward, ep.turns) == ("done", True, 1.0, 2)
    assert ep.reward_info()["tool_calls_valid"] == 1


def test_behaviour_versions_span_every_turn(tok):
    scripts = {"P\n": [("a", "stop", 3), ("b", "stop", 5)]}
    (ep,), _ = play(tok, scripts, [sample("P\n", done_after=2)])
    assert (ep.behaviour_version_min, ep.behaviour_version_max) == (3, 5)
    assert ep.row_fields(policy_version=9)["behaviour_version_max"] == 5


# ---------------------------------------------------------------------------- env failures


def test_env_errors_end_only_their_episode_with_the_reason_recorded(tok):
    turns = [("ab", "stop", 0)] * 3
    names = ("ok", "step", "reset", "malformed", "format")
    scripts = {f"{n}\n": list(turns) for n in names}
    samples = [sample(f"{n}\n", done_after=3, fail=n) for n in names]
    episodes, _ = play(tok, scripts, samples)
    alone, _ = play(tok, {"ok\n": list(turns)}, [samples[0]])
    ok, step, reset, malformed, fmt = episodes
    assert ok == alone[0] and ok.end_reason == "done"
    assert step.reward_info()["env_error"] == {
        "phase": "step",
        "type": "ZeroDivisionError",
        "message": "env bug on turn 2",
    }
    assert (step.turns, step.turn_rewards, step.finish_reason) == (2, [0.5], "abort")
    assert reset.error.phase == "reset" and reset.response_ids == [] and reset.turns == 0
    assert malformed.error.phase == "step" and "4-tuple" in malformed.error.message
    assert fmt.error.phase == "format_observation" and fmt.error.message == "cannot show that"
    for ep in (step, reset, malformed, fmt):
        assert (ep.end_reason, ep.finish_reason, ep.correct) == ("env_error", "abort", False)
    # Every episode, failed or not, is a valid queue row: no sample is silently lost.
    rows = [
        {"uid": f"g-s{i}", "group_id": "g", "prompt_ids": [1], **ep.row_fields(policy_version=4)}
        for i, ep in enumerate(episodes)
    ]
    table = rows_to_table(rows)
    assert table.column("behaviour_version_min").to_pylist()[2] == 4  # reset failed: no turns


def test_an_env_factory_that_raises_costs_only_its_episodes(tok):
    def factory():
        raise OSError("simulator down")

    engine = ScriptedEngine(tok, {})
    (ep,) = run_episodes(
        engine,
        tok,
        factory,
        [sample("P\n")],
        [ids_of(tok, "P\n")],
        PARAMS,
        LIMITS,
        ObservationRenderer(tok, "plain"),
    )
    assert ep.error.to_info() == {"phase": "reset", "type": "OSError", "message": "simulator down"}
    assert engine.calls == []


# ---------------------------------------------------------------------------- rendering


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_chat_observations_continue_the_template_conversation():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    row = {"prompt": "What is 12*3?", "answer": "36"}
    prompt = ids_of(tok, render_prompt(row["prompt"], "chat", tok))
    engine = ScriptedEngine(tok, {})
    engine.scripts = {tuple(prompt): [("calc(12*3)", "stop", 0), ("Answer: 36", "stop", 0)]}
    render = ObservationRenderer(tok, "chat")
    factory = resolve_env("calculator")
    (ep,) = run_episodes(engine, tok, factory, [row], [prompt], PARAMS, LIMITS, render)
    conversation = [
        {"role": "user", "content": "What is 12*3?"},
        {"role": "assistant", "content": "calc(12*3)"},
        {"role": "tool", "content": "36"},
        {"role": "assistant", "content": "Answer: 36"},
    ]
    whole = tok.apply_chat_template(conversation, tokenize=False)
    # The episode stops at the model's last EOS; the template adds a newline after it.
    assert tok.decode(prompt + ep.response_ids) + "\n" == whole
    observation = ids_of(tok, "\ntool: 36</s>\nassistant: ")
    start = len(ids_of(tok, "calc(12*3)")) + 1
    assert ep.response_ids[start : start + len(observation)] == observation
    assert ep.loss_mask[start : start + len(observation)] == [0] * len(observation)
    assert sum(ep.loss_mask) == len(ep.response_ids) - len(observation)


def test_a_template_that_refuses_the_role_is_an_env_error():
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'env' %}{{ raise_exception('no env role') }}"
        "{% endif %}{{ m['content'] }}{% endfor %}"
    )
    (ep,), _ = play(
        tok, {"P\n": [("a", "stop", 0)]}, [sample("P\n")], render=ObservationRenderer(tok, "chat")
    )
    assert ep.error.phase == "format_observation"
    assert "cannot render a 'env' message" in ep.error.message and "no env role" in ep.error.message


def test_plain_renderer_refuses_a_chat_template_it_lacks(tok):
    with pytest.raises(ValueError, match="has no chat template"):
        ObservationRenderer(tok, "chat")
    with pytest.raises(ValueError, match="unknown prompt template"):
        ObservationRenderer(tok, "markdown")


class FakeMedia:
    """One placeholder per item; an item's 'encoder input' is a string naming it."""

    def __init__(self, placeholder: int) -> None:
        self.placeholder = placeholder

    def placeholder_ids(self, items):
        return [self.placeholder] * len(items)

    def inputs(self, items):
        return [f"enc:{item['uri']}" for item in items]


def test_observation_media_reach_the_next_turn_and_the_row(tok):
    image = {"kind": "image", "uri": "frame1.png"}
    placeholder = tok.unk_token_id
    render = ObservationRenderer(tok, "plain", FakeMedia(placeholder))
    scripts = {"P\n": [("a", "stop", 0), ("b", "stop", 0)]}
    (ep,), engine = play(
        tok,
        scripts,
        [sample("P\n", done_after=2, media=[image])],
        render=render,
        media=[["prompt-img"]],
    )
    assert [c["media"] for c in engine.calls] == [
        [["prompt-img"]],
        [["prompt-img", "enc:frame1.png"]],
    ]
    observation = ids_of(tok, "\nenv: ") + [placeholder] + ids_of(tok, "obs1\n")
    assert ep.response_ids[2 : 2 + len(observation)] == observation
    assert ep.media == [{"kind": "image", "uri": "frame1.png", "bytes": None}]


def test_media_for_a_text_policy_is_an_env_error(tok):
    image = {"kind": "image", "bytes": b"\x89PNG"}
    (ep,), engine = play(tok, {"P\n": [("a", "stop", 0)]}, [sample("P\n", media=[image])])
    assert ep.error.phase == "format_observation" and "takes text only" in ep.error.message
    assert engine.calls[0]["media"] is None  # a text episode never sends media


# ---------------------------------------------------------------------------- metrics, demos


def test_episode_metrics(tok):
    scripts = {"A\n": [("a", "stop", 0)] * 2, "B\n": [("b", "stop", 0)] * 2}
    episodes, _ = play(tok, scripts, [sample("A\n", done_after=2), sample("B\n", fail="step")])
    m = episode_metrics(episodes, "eval")
    assert m["eval/success_rate"] == 0.5 and m["eval/mean_turns"] == 2.0
    # A: turns 1 (valid) and 2 (invalid); B: turn 1 (valid), turn 2 raised.
    assert m["eval/tool_calls"] == 1.5 and m["eval/tool_call_validity"] == pytest.approx(2 / 3)
    assert m["eval/env_errors"] == 1.0
    assert m["eval/end/done"] == m["eval/end/env_error"] == 0.5
    assert {k.split("/")[-1] for k in m if "/end/" in k} == set(END_REASONS)


def test_a_demonstration_shorter_than_the_env_wants_is_refused(tok):
    row = {"prompt": "What is 12*3?\n", "answer": "36"}
    with pytest.raises(ValueError, match="demonstration has 1 turns"):
        demonstration_episode(
            tok,
            resolve_env("calculator"),
            row,
            ids_of(tok, row["prompt"]),
            ["calc(12*3)"],
            LIMITS,
            ObservationRenderer(tok, "plain"),
        )


# ---------------------------------------------------------------------------- real engine


@pytest.fixture(scope="module")
def policy(tok):
    """The tiny Qwen3 with an EOS bias on its head, so turns end after a few tokens and
    episodes have several turns; the rest of the head stays context-dependent."""
    model = build_tiny_qwen3(SMALL, len(tok), seed=0)
    old = model.lm_head
    head = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(old.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 3.0  # p(EOS) ~ e^3 / (e^3 + 78) ~ 0.2 per token
    model.lm_head = head
    return model


@pytest.fixture(scope="module")
def real_episodes(tok, policy):
    engine = TorchEngine(policy, tok.eos_token_id, tok.pad_token_id, seed=3)
    samples = [sample(f"{k}\n") for k in "ABCDEFGH" for _ in range(4)]  # groups of 4
    prompts = [ids_of(tok, s["prompt"]) for s in samples]
    params = SamplingParams(max_new_tokens=12, temperature=0.9)
    render = ObservationRenderer(tok, "plain")
    limits = EpisodeLimits(max_turns=3, max_episode_tokens=60)
    episodes = run_episodes(engine, tok, ScriptEnv, samples, prompts, params, limits, render)
    return prompts, episodes


def test_real_engine_masks_match_a_transcript_rebuilt_by_hand(tok, real_episodes):
    _, episodes = real_episodes
    eos = tok.eos_token_id
    for ep in episodes:
        ids, pos, mask, turn = ep.response_ids, 0, [], 0
        while pos < len(ids):
            turn += 1
            end = ids.index(eos, pos) + 1 if eos in ids[pos:] else len(ids)
            mask += [1] * (end - pos)  # the model's turn, through its EOS
            pos = end
            if pos < len(ids):
                expected = obs_ids(tok, turn)
                assert ids[pos : pos + len(expected)] == expected
                mask += [0] * len(expected)
                pos += len(expected)
        assert ep.loss_mask == mask and turn == ep.turns
        assert len(ids) <= 60
    ends = {ep.end_reason for ep in episodes}
    assert "max_turns" in ends and ends & {"turn_length", "token_budget"}


def test_real_engine_logprobs_are_the_trainers_on_model_tokens(tok, policy, real_episodes):
    prompts, episodes = real_episodes
    mb = make_micro_batch(
        prompts, [ep.response_ids for ep in episodes], [ep.loss_mask for ep in episodes], 0
    )
    with torch.no_grad():
        trainer_lp, _ = response_logprobs(policy, mb, temperature=0.9)
    for row, ep in enumerate(episodes):
        n = len(ep.response_ids)
        rollout = torch.tensor(ep.rollout_logprobs)
        model = torch.tensor(ep.loss_mask, dtype=torch.bool)
        assert torch.allclose(rollout[model], trainer_lp[row, :n][model], atol=1e-4)
        assert torch.all(rollout[~model] == 0.0)


def _loss_batch(tok, prompts, episodes, scramble: bool):
    """A micro-batch with advantages and log-prob columns; `scramble` puts garbage in them at
    observation positions, where no loss may read them."""
    extras: dict[str, list[list[float]]] = {"advantages": [], "rollout": [], "ref": []}
    for i, ep in enumerate(episodes):
        adv = 1.0 if i % 2 else -1.0
        rows = {
            "advantages": [adv] * len(ep.response_ids),  # broadcast over every token
            "rollout": list(ep.rollout_logprobs),
            "ref": [lp - 0.1 for lp in ep.rollout_logprobs],
        }
        for name, values in rows.items():
            if scramble:
                values = [v if m else 1e4 for v, m in zip(values, ep.loss_mask, strict=True)]
            extras[name].append(values)
    return make_micro_batch(
        prompts,
        [ep.response_ids for ep in episodes],
        [ep.loss_mask for ep in episodes],
        tok.pad_token_id,
        extras,
    )


def _observation_positions(episodes, width: int) -> torch.Tensor:
    obs = torch.zeros((len(episodes), width), dtype=torch.bool)
    for i, ep in enumerate(episodes):
        obs[i, : len(ep.loss_mask)] = torch.tensor(ep.loss_mask) == 0
    return obs


SETTINGS = LossSettings(kl_coef=0.1, entropy_coef=0.01, is_mode="tis")


def _loss(loss_name, mb, logprobs, entropy):
    inputs = LossInputs(
        logprobs=logprobs,
        old_logprobs=mb.extras["rollout"],
        advantages=mb.extras["advantages"],
        loss_mask=mb.loss_mask,
        ref_logprobs=mb.extras["ref"],
        rollout_logprobs=mb.extras["rollout"],
        entropy=entropy,
    )
    return POLICY_LOSSES[loss_name](inputs, SETTINGS)[0]


@pytest.fixture(scope="module")
def scored(tok, policy, real_episodes):
    """The real episodes' micro-batch and the policy's log-probs and entropy on it."""
    prompts, episodes = real_episodes
    mb = _loss_batch(tok, prompts, episodes, scramble=False)
    with torch.no_grad():
        logprobs, entropy = response_logprobs(policy, mb, 1.0)
    return mb, logprobs, entropy


@pytest.mark.parametrize("loss_name", sorted(POLICY_LOSSES))
def test_observation_log_probs_get_exactly_zero_gradient(real_episodes, scored, loss_name):
    # With KL, entropy bonus and importance correction on: every term that reads a token.
    _, episodes = real_episodes
    mb, logprobs, entropy = scored
    lp, ent = logprobs.clone().requires_grad_(), entropy.clone().requires_grad_()
    g_lp, g_ent = torch.autograd.grad(_loss(loss_name, mb, lp, ent), (lp, ent))
    obs = _observation_positions(episodes, lp.shape[1])
    assert obs.sum() > 50
    assert torch.all(g_lp[obs] == 0) and torch.all(g_ent[obs] == 0)
    assert g_lp[mb.loss_mask > 0].abs().sum() > 0


def test_observation_values_leave_the_parameter_gradient_unchanged(tok, policy, real_episodes):
    # Through the model: garbage in every column at observation positions (advantages and
    # old/ref/rollout log-probs) leaves the parameters' gradient bit-for-bit unchanged.
    prompts, episodes = real_episodes
    assert (
        _observation_positions(episodes, 1 + max(len(ep.loss_mask) for ep in episodes)).sum() > 50
    )
    grads = []
    for scramble in (False, True):
        mb = _loss_batch(tok, prompts, episodes, scramble)
        policy.zero_grad(set_to_none=True)
        _loss("grpo", mb, *response_logprobs(policy, mb, 1.0)).backward()
        grads.append([p.grad.clone() for p in policy.parameters() if p.grad is not None])
    policy.zero_grad(set_to_none=True)
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
