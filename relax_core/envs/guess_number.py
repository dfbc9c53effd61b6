"""Guess-the-number env: find a hidden number in 1..N from higher/lower feedback.

    prompt: Guess my number from 1 to 16.
    model:  Guess: 8
    user:   higher                the hidden number is higher than the guess ("lower": below it)
    model:  Guess: 12
    ...                           the episode ends on the right guess or after `max_guesses`
Reward on success is 1 - turn_penalty * (guesses - 1), so a shorter search scores more; failure
scores 0. A turn without a readable guess in range gets the feedback "invalid" and still counts as
a guess. Formats use only characters of the tiny char tokenizer; `demonstration` plays binary
search, which a tiny model can imitate because every interval it needs is spelled out in the
feedback history.
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping
from typing import Any

from relax_core.envs.protocol import INFO_CORRECT, StepResult

GUESS = re.compile(r"Guess:\s*(-?\d{1,6})")
HIGHER, LOWER, INVALID = "higher", "lower", "invalid"
DEFAULT_HIGH = 16


class GuessNumberEnv:
    """One game; the hidden number is the row's answer, the range 1..meta.high."""

    def __init__(self, max_guesses: int | str = 6, turn_penalty: float | str = 0.1) -> None:
        # Config kwargs arrive as strings (config/load.py keeps mappings as str -> str).
        self.max_guesses = int(max_guesses)
        self.turn_penalty = float(turn_penalty)
        if self.max_guesses < 1:
            raise ValueError(f"max_guesses must be >= 1, got {self.max_guesses}")
        if not 0.0 <= self.turn_penalty <= 1.0:
            raise ValueError(f"turn_penalty must be in [0, 1], got {self.turn_penalty}")
        self.target, self.high, self.guesses = 0, DEFAULT_HIGH, 0

    def reset(self, sample: Mapping[str, Any]) -> None:
        self.high = int((sample.get("meta") or {}).get("high", DEFAULT_HIGH))
        self.target = int(str(sample["answer"]).strip())
        if not 1 <= self.target <= self.high:
            raise ValueError(f"answer {self.target} is outside 1..{self.high}")
        self.guesses = 0
        return None

    def step(self, action_text: str) -> StepResult:
        if self.target == 0:
            raise RuntimeError("step() before reset()")
        self.guesses += 1
        found = GUESS.search(action_text)
        guess = int(found.group(1)) if found else None
        valid = guess is not None and 1 <= guess <= self.high
        info: dict[str, Any] = {"guess": guess, "valid_guess": valid, "guesses": self.guesses}
        if valid and guess == self.target:
            reward = max(0.0, 1.0 - self.turn_penalty * (self.guesses - 1))
            return StepResult(None, reward, True, {**info, INFO_CORRECT: True})
        if self.guesses >= self.max_guesses:
            return StepResult(None, 0.0, True, {**info, INFO_CORRECT: False})
        feedback = INVALID if not valid else HIGHER if self.target > guess else LOWER
        return StepResult(feedback, 0.0, False, info)

    def format_observation(self, observation: Any) -> dict[str, Any]:
        return {"role": "user", "content": str(observation)}


def prompt_for(high: int) -> str:
    return f"Guess my number from 1 to {high}.\n"


def generate(
    seed: int = 0, high: int = DEFAULT_HIGH, train_size: int = 2048, eval_size: int = 64
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train_rows, eval_rows). Train targets are drawn uniformly with `seed`; eval cycles
    through 1..high in order, so every target is scored equally often."""
    if high < 2:
        raise ValueError(f"high must be >= 2, got {high}")
    rng = random.Random(seed)
    train = [_row(rng.randint(1, high), high) for _ in range(train_size)]
    eval_ = [_row(1 + i % high, high) for i in range(eval_size)]
    return train, eval_


def _row(target: int, high: int) -> dict[str, Any]:
    meta = {"env": "guess_number", "low": 1, "high": high}
    return {"prompt": prompt_for(high), "answer": str(target), "meta": meta}


def demonstration(sample: Mapping[str, Any]) -> list[str]:
    """The model turns of binary search for the row's number (midpoint rounded down)."""
    target = int(str(sample["answer"]).strip())
    low, high = 1, int((sample.get("meta") or {}).get("high", DEFAULT_HIGH))
    if not low <= target <= high:
        raise ValueError(f"answer {target} is outside {low}..{high}")
    turns = []
    while True:
        guess = (low + high) // 2
        turns.append(f"Guess: {guess}")
        if guess == target:
            return turns
        low, high = (guess + 1, high) if target > guess else (low, guess - 1)
