"""The service of each async-mode role, by name: what a Flyte role task or
`python -m relax_core.entrypoints.role` serves."""

from __future__ import annotations

from collections.abc import Callable

from relax_core.roles import actor_fwd, advantages, reference, rollout_service, trainer_service
from relax_core.roles.service import ROLES, RoleContext

SERVES: dict[str, Callable[[RoleContext], None]] = {
    "rollout": rollout_service.serve,
    "reference": reference.serve,
    "actor_fwd": actor_fwd.serve,
    "advantages": advantages.serve,
    "trainer": trainer_service.serve,
}
assert tuple(SERVES) == ROLES


def serve_fn(role: str) -> Callable[[RoleContext], None]:
    """The `serve` function of `role`."""
    if role not in SERVES:
        raise ValueError(f"unknown role {role!r}; roles are {list(SERVES)}")
    return SERVES[role]
