"""Importing a user's own code named in a config as "module:attribute" (a reward function, an env
class: the only import-path strings a config may hold). Every failure names the spec and what is
wrong, so a bad config stops the run before any work starts."""

from __future__ import annotations

import importlib


def import_attribute(spec: str, what: str, form: str) -> object:
    """The attribute `attr` of `module` for `spec` "module:attr" (dotted paths such as
    "pkg.mod:Scorer.score" are followed). `what` names the setting in errors ("user reward",
    "env"); `form` shows how to write it ("'module:function', e.g. 'my_pkg.rewards:score'").
    Raises ValueError for a malformed spec, a module that cannot be imported or a missing
    attribute."""
    module_name, sep, attr_path = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    module_name, attr_path = module_name.strip(), attr_path.strip()
    if not sep or not module_name or not attr_path or ":" in attr_path:
        raise ValueError(f"{what} {spec!r} must be written {form}")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name + ".").startswith(e.name + "."):
            raise ValueError(
                f"{what} {spec!r}: module {module_name!r} cannot be found; "
                "is it installed or on PYTHONPATH?"
            ) from e
        raise ValueError(f"{what} {spec!r}: importing {module_name!r} failed: {e}") from e
    except Exception as e:
        raise ValueError(
            f"{what} {spec!r}: importing {module_name!r} failed: {type(e).__name__}: {e}"
        ) from e
    target: object = module
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr_path!r}")
        target = getattr(target, part)
    return target
