"""Loading a user's own reward function given as "module:function" (the one import-path string a
config may hold). Every failure names the spec and what is wrong, so a bad config stops the run
before any work starts."""

from __future__ import annotations

import inspect

from relax_core.rewards.result import RewardFn
from relax_core.user_code import import_attribute


def load_user_reward(spec: str) -> RewardFn:
    """Import `module` and return its attribute `function` (dotted paths such as
        "pkg.mod:Scorer.score" are followed). Raises ValueError for a bad spec, a module that cannot be
    imported or a missing attribute; TypeError for something that is not a 3-argument callable."""
    fn = import_attribute(spec, "user reward", "'module:function', e.g. 'my_pkg.rewards:score'")
    _check_callable(spec, fn)
    return fn  # type: ignore[return-value]


def _check_callable(spec: str, fn: object) -> None:
    if not callable(fn):
        raise TypeError(f"user reward {spec!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no signature; the call itself will tell
    try:
        signature.bind(None, None, None)
    except TypeError as e:
        raise TypeError(
            f"user reward {spec!r} must accept (response, answer, sample); "
            f"its signature is {signature}: {e}"
        ) from e
