"""A small OpenEnv environment written the way OpenEnv's own env template writes one, for
tests/integration/test_openenv_env.py: run in process, and served by OpenEnv's `create_app`
(`python -m uvicorn tests.integration.openenv_echo:app`).

Guess a digit: reset(seed) hides `seed`; each guess gets "higher" or "lower", and the right one
ends the episode with reward 1.0 (other guesses: reward None). A guess "boom" makes step() raise.
"""

from __future__ import annotations

from typing import Any

from openenv.core import Action, Environment, Observation, State, create_app

SESSIONS = 4
"""WebSocket sessions the served app holds at once."""


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    feedback: str = ""
    tries: int = 0


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, greeting: str = "guess a digit") -> None:
        super().__init__()
        self.greeting, self.target = greeting, 0
        self._state = State(step_count=0)

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self.target = 7 if seed is None else int(seed)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(feedback=self.greeting)

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any):
        if action.guess.strip() == "boom":
            raise ValueError("the guess blew up")
        self._state.step_count += 1
        tries = self._state.step_count
        guess = int(action.guess.strip())
        if guess == self.target:
            return GuessObservation(
                feedback="right", tries=tries, done=True, reward=1.0, metadata={"hit": True}
            )
        feedback = "higher" if guess < self.target else "lower"
        return GuessObservation(feedback=feedback, tries=tries, metadata={"hit": False})

    @property
    def state(self) -> State:
        return self._state


def answer_action(text: str) -> GuessAction:
    """An action builder: the model writes 'Answer: 3', the env takes the guess '3'."""
    return GuessAction(guess=text.rsplit(":", 1)[-1].strip())


app = create_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=SESSIONS)
