"""The two checks most config fields share; every message names the dotted field path."""

from __future__ import annotations


def choice(errors: list[str], path: str, value: str, allowed: tuple[str, ...]) -> None:
    """`value` must be one of `allowed`."""
    if value not in allowed:
        errors.append(f"{path}: {value!r} is not one of {', '.join(allowed)}")


def positive(errors: list[str], path: str, value: float, allow_zero: bool = False) -> None:
    """`value` must be > 0 (>= 0 with `allow_zero`)."""
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        errors.append(f"{path}: must be {bound}, got {value}")
