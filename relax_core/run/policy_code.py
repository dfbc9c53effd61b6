"""The version of the code that prepares starting policies, as a digest of its source.

Flyte caches `prepare_policy` on its inputs plus a `cache_version`; the inputs name the settings
(PolicySpec), so a cache_version that never changed would serve a policy an older warm start or
conversion made. This digest changes whenever a file that shapes a prepared policy does.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPING = (
    "run/prepare.py",
    "models/*.py",
    "train/warm_start.py",
    "data/templates.py",
    "data/dataset.py",
    "rollout/demonstrations.py",
    "multimodal/qwen/*.py",
)
"""What decides the weights `prepare_policy` writes (relax_core-relative globs)."""


@functools.cache
def policy_code_version() -> str:
    """16 hex digits over the source of SHAPING (paths and contents, in order)."""
    digest = hashlib.sha256()
    for pattern in SHAPING:
        paths = sorted(ROOT.glob(pattern))
        if not paths:
            raise FileNotFoundError(f"policy_code: {pattern} matches nothing under {ROOT}")
        for path in paths:
            digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]
