"""A reward that scores like `math` after a fixed delay: the stand-in for a verifier that runs
elsewhere (a code sandbox, a remote checker), during which a rollout engine waits instead of
computing. `bench/elastic.py --reward-latency-ms N` configures it as the run's reward
(`reward.name: bench.remote_verifier:score`); the delay per sample comes from
RELAX_BENCH_REWARD_LATENCY_MS.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from relax_core.rewards.math import math_reward
from relax_core.rewards.result import RewardResult

LATENCY_S = float(os.environ.get("RELAX_BENCH_REWARD_LATENCY_MS", "0")) / 1000.0


def score(response: str, answer: str, sample: Mapping[str, Any]) -> RewardResult:
    time.sleep(LATENCY_S)
    return math_reward(response, answer, sample)
