"""Loading a user's own reward function given as "module:function" (the one import-path string a
config may hold). Every failure names the spec and what is wrong, so a bad config stops the run
before any work starts."""

from __future__ import annotations

import importlib
import inspect

from relax_core.rewards.result import RewardFn


def load_user_reward(spec: str) -> RewardFn:
    """Import `module` and return its attribute `function` (dotted paths such as
        "pkg.mod:Scorer.score" are followed). Raises ValueError for a bad spec, a module that cannot be
    imported or a missing attribute; TypeError for something that is not a 3-argument callable."""
    module_name, sep, attr_path = spec.partition(":")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(
            f"user reward {spec!r} must be written 'module:function', e.g. 'my_pkg.rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ValueError(
                f"user reward {spec!r}: module {module_name!r} cannot be found; "
                "is it installed or on PYTHONPATH?"
            ) from e
        raise ValueError(f"user reward {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise ValueError(
            f"user reward {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    fn: object = module
    for part in attr_path.split("."):
        if not hasattr(fn, part):
            raise ValueError(f"user reward {spec!r}: module {module_name!r} has no {attr_path!r}")
        fn = getattr(fn, part)
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
