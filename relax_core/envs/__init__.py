"""Agentic environments: the Env protocol, the loader for a user's 'module:Class', and two
example envs (a calculator tool, guess-the-number) a tiny CPU model can learn.

May import: config.
"""

from relax_core.envs.protocol import (
    INFO_CORRECT,
    INFO_TOOL_CALL_VALID,
    Env,
    EnvFactory,
    EnvFailure,
    StepResult,
    as_step_result,
    load_env,
)
from relax_core.envs.registry import DEMONSTRATIONS, ENVS, resolve_env

__all__ = [
    "DEMONSTRATIONS",
    "ENVS",
    "INFO_CORRECT",
    "INFO_TOOL_CALL_VALID",
    "Env",
    "EnvFactory",
    "EnvFailure",
    "StepResult",
    "as_step_result",
    "load_env",
    "resolve_env",
]
